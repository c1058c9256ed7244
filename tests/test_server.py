"""``steerable serve`` end to end (issue 10): a real server in a subprocess on the tiny Qwen3, driven
with the ``openai`` package (sync and async) and raw HTTP. Every greedy answer, steered or not,
must equal ``LLM.generate`` offline with the same parameters, and decoded captures must equal the
offline captures bit for bit (a fresh ``cache_salt`` keeps both sides off the prefix cache)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import time
import uuid

import httpx
import numpy as np
import openai
import pytest
import torch
from server_harness import (ADMIN, MAX_BODY_BYTES, SERVED_NAME, USER, USER_KEY, app_in_thread, assert_nothing_held,
                            metrics, wait_idle)

from steerable import LLM, Add, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.entrypoints.openai.launcher import free_port
from steerable.capture import deserialize_captured, match_capture_request_id

PROMPTS = ["Hello world", "The quick brown fox jumps", "Steering vectors shift", "Paged attention stores keys"]
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def vector(seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale


def b64(v: torch.Tensor) -> dict:
    data = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
    return {"dtype": "float32", "shape": [v.numel()], "data": data}


def run_offline(llm: LLM, prompt, **kwargs):
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def salt() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------- OpenAI surface

def test_completions_match_offline(client, offline):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    prompt_tokens = 0
    for choice, prompt in zip(r.choices, PROMPTS):
        ref = run_offline(offline, prompt, max_tokens=8, temperature=0)
        assert (choice.text, choice.token_ids, choice.finish_reason) == \
            (ref.outputs[0].text, ref.outputs[0].token_ids, ref.outputs[0].finish_reason)
        assert choice.prompt_token_ids == ref.prompt_token_ids
        prompt_tokens += len(ref.prompt_token_ids)
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 4 * 8


def test_token_id_prompts_n_seed_logprobs_penalties(client, offline):
    ids = offline.get_tokenizer()(PROMPTS[1]).input_ids
    kwargs = dict(max_tokens=6, temperature=0.9, top_p=0.95, seed=123, n=2, presence_penalty=0.5,
                  frequency_penalty=0.25)
    r = client.completions.create(model=SERVED_NAME, prompt=ids, logprobs=2, **kwargs,
                                  extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2,
                                              "return_token_ids": True})
    ref = run_offline(offline, ids, logprobs=2, top_k=20, min_p=0.01, repetition_penalty=1.2, **kwargs)
    assert len(r.choices) == 2
    for choice, completion in zip(r.choices, ref.outputs):
        assert choice.token_ids == completion.token_ids and choice.text == completion.text
        expected = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        np.testing.assert_allclose(choice.logprobs.token_logprobs, expected, rtol=0, atol=1e-5)
        assert all(token in top for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs))
    assert r.choices[0].token_ids != r.choices[1].token_ids  # seed, seed + 1


def test_stop_strings_and_ids(client, offline):
    free = run_offline(offline, PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True).outputs[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    ref = run_offline(offline, PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]).outputs[0]
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    stop_id = free.token_ids[5]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "min_tokens": 2, "return_token_ids": True})
    ref = run_offline(offline, PROMPTS[2], max_tokens=12, temperature=0, stop_token_ids=[stop_id],
                      min_tokens=2).outputs[0]
    assert r.choices[0].token_ids == ref.token_ids and r.choices[0].finish_reason == ref.finish_reason


def test_chat_matches_offline_and_streams_with_usage(client, offline):
    ref = offline.chat(MESSAGES, SamplingParams(n=2, max_tokens=10, temperature=0, logprobs=1), use_tqdm=False)[0]
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, n=2, max_completion_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=1)
    assert [c.message.content for c in r.choices] == [c.text for c in ref.outputs]
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].logprobs.content) == 10
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, n=2, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts, roles, finishes = {0: "", 1: ""}, {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)  # the first chunk of each choice
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    assert [texts[0], texts[1]] == [c.text for c in ref.outputs]
    assert finishes == {0: ref.outputs[0].finish_reason, 1: ref.outputs[1].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_async_client_streams_completions(server, offline):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=USER_KEY, max_retries=0) as aclient:
            async def one(prompt):
                stream = await aclient.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                                          temperature=0, stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            return await asyncio.gather(*[one(p) for p in PROMPTS])

    texts = asyncio.run(main())
    assert texts == [run_offline(offline, p, max_tokens=8, temperature=0).outputs[0].text for p in PROMPTS]


def test_steered_requests_match_offline(client, offline):
    v, w = vector(1), vector(2)
    spec = SteeringSpec(interventions=[Add(0, w, hook="pre_attn", select=SelectSpec(prompt_positions=[-1]))],
                        prefill_vectors={2: v}, decode_vectors={"post_attn": {1: w}},
                        clamps=[Clamp(2, v, min=-1.0, max=1.0)], scale=0.75)
    forms = [({"1": v.tolist()}, {1: v}),
             ({"post_attn": {"2": {"vector": b64(w), "scale": 0.5}}}, {"post_attn": {2: {"vector": w, "scale": 0.5}}}),
             (spec.to_dict(encoding="base64"), spec)]
    plain = run_offline(offline, PROMPTS[0], max_tokens=8, temperature=0).outputs[0].text
    for wire, steering in forms:
        r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                      extra_body={"steering_vectors": wire, "return_token_ids": True})
        ref = run_offline(offline, PROMPTS[0], max_tokens=8, temperature=0, steering_vectors=steering).outputs[0]
        assert r.choices[0].token_ids == ref.token_ids and r.choices[0].text != plain


def test_named_module_with_scale(client, offline, http):
    v = vector(3)
    assert http.post("/v1/steering/modules", json={"calm": {"1": v.tolist()}}, headers=ADMIN).status_code == 200
    assert "calm" in http.get("/v1/steering/modules", headers=USER).json()["modules"]
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                  extra_body={"steering_module_ref": {"name": "calm", "scale": 0.5},
                                              "return_token_ids": True})
    offline.register_steering_modules({"calm": {1: v}})
    try:
        ref = run_offline(offline, PROMPTS[3], max_tokens=8, temperature=0, steering_module_ref=("calm", 0.5))
    finally:
        offline.unregister_steering_modules(["calm"])
    assert r.choices[0].token_ids == ref.outputs[0].token_ids
    assert http.delete("/v1/steering/modules/calm", headers=ADMIN).status_code == 200
    assert http.delete("/v1/steering/modules/calm", headers=ADMIN).status_code == 404
    with pytest.raises(openai.BadRequestError, match="steering_module_ref"):
        client.completions.create(model=SERVED_NAME, prompt="x", extra_body={"steering_module_ref": "calm"})


CAPTURE_WIRE = [{"layers": [0, 2], "select": "all_prompt"},
                {"component": "attention_heads", "layers": [1], "select": {"generation": "all"}, "dtype": "bfloat16"}]
CAPTURE_SPECS = [CaptureSpec(layers=[0, 2], select="all_prompt"),
                 CaptureSpec(stream="attention_heads", layers=[1], select={"generation": "all"}, dtype="bfloat16")]


def assert_captures_equal(choice_captures: dict, completion, request_id: str) -> None:
    assert set(choice_captures) == set(completion.captures)
    for component, wire in choice_captures.items():
        tensors, metas = deserialize_captured(json.loads(json.dumps(wire)))  # JSON as it came, as is
        assert set(tensors) == set(completion.captures[component])
        for layer, tensor in tensors.items():
            ref, meta = completion.captures[component][layer], completion.capture_meta[component][layer]
            assert tensor.dtype == ref.dtype and torch.equal(tensor, ref)
            assert torch.equal(metas[layer].positions, meta.positions)
            assert torch.equal(metas[layer].token_ids, meta.token_ids)
            assert all(match_capture_request_id(label, request_id) for label in metas[layer].req_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_captures_match_offline_exactly(client, offline, stream):
    cache_salt = salt()
    kwargs = dict(max_tokens=6, temperature=0.9, seed=5, n=2)
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], stream=stream, **kwargs,
                                  extra_body={"capture": CAPTURE_WIRE, "cache_salt": cache_salt})
    ref = run_offline(offline, PROMPTS[1], capture=CAPTURE_SPECS, cache_salt=cache_salt, **kwargs)
    if stream:  # the captures ride on each choice's final chunk
        chunks = list(r)
        finals = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason is not None}
        choices, request_id = [finals[0], finals[1]], chunks[0].id
    else:
        choices, request_id = r.choices, r.id
    for choice, completion in zip(choices, ref.outputs):
        assert_captures_equal(choice.captures, completion, request_id)
    assert ref.outputs[0].capture_meta["hidden_states"][0].positions.tolist() == list(range(len(ref.prompt_token_ids)))


def test_capture_reductions_and_400(client, offline):
    long_prompt = " ".join(PROMPTS * 8)
    big = {"layers": [0, 1, 2]}
    with pytest.raises(openai.BadRequestError) as err:  # a parameter over a limit, as OpenAI answers it
        client.completions.create(model=SERVED_NAME, prompt=long_prompt, max_tokens=100, extra_body={"capture": big})
    assert err.value.status_code == 400
    message = err.value.body["message"]
    assert "--max-capture-bytes" in message and "stream" in message and err.value.body["param"] == "capture"
    cache_salt = salt()
    small = [{"layers": [0, 1, 2], "reduce": "mean"}, {"component": "attention_heads", "reduce": "last",
                                                        "budget_rows": 1}]
    r = client.completions.create(model=SERVED_NAME, prompt=long_prompt, max_tokens=3, temperature=0,
                                  extra_body={"capture": small, "cache_salt": cache_salt})
    ref = run_offline(offline, long_prompt, max_tokens=3, temperature=0, cache_salt=cache_salt,
                      capture=[CaptureSpec(layers=[0, 1, 2], reduce="mean"),
                               CaptureSpec(stream="attention_heads", reduce="last", budget_rows=1)])
    assert_captures_equal(r.choices[0].captures, ref.outputs[0], r.id)
    assert ref.outputs[0].captures["hidden_states"][0].shape == (1, 64)


BAD_REQUESTS = [  # (body or raw bytes, status, the field the error names)
    ({"steering_vectors": {"1": [1.0, 2.0]}}, 400, "steering_vectors"),
    (b'{"prompt": "x", "steering_vectors": {"1": [NaN' + b", 0.0" * 63 + b"]}}", 400, "steering_vectors"),
    ({"steering_vectors": {"1": {"dtype": "float32", "shape": [64], "data": "!!"}}}, 400, "steering_vectors"),
    ({"steering_vectors": {"9": [0.0] * 64}}, 400, "steering_vectors"),
    ({"steering_vectors": {"mid": {"1": [0.0] * 64}}}, 400, "steering_vectors"),
    ({"steering_vectors": {"vectors": {"1": [0.0] * 64}, "scales": 2}}, 400, "steering_vectors.scales"),
    ({"steering_module_ref": "nope"}, 400, "steering_module_ref"),
    ({"steering_module_ref": {"name": "nope", "scael": 1}}, 400, "steering_module_ref.scael"),
    ({"capture": {"select": {"prompt_positions": "x"}}}, 400, "capture.select"),
    ({"capture": {"layer": [1]}}, 400, "capture.layer"),
    ({"capture": {"layers": [7]}}, 400, "capture.layers"),
    ({"capture": {"component": "mlp"}}, 400, "capture.component"),
    ({"steer": {"1": [0.0] * 64}}, 400, "steer"),
    ({"captures": {}}, 400, "captures"),
    ({"max_tokens": "x"}, 400, "max_tokens"),
    ({"max_tokens": 600}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"temperature": -1}, 400, "temperature"),
    ({"logprobs": 50}, 400, "logprobs"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"model": "other"}, 404, "model"),
    (b'{"prompt": "x", ', 400, "body"),
    (b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}', 413, "body"),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_requests_name_the_field(http, body, status, param):
    if isinstance(body, dict):
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, **body}, headers=USER)
    else:
        r = http.post("/v1/completions", content=body, headers={**USER, "Content-Type": "application/json"})
    error = r.json()["error"]
    assert (r.status_code, error["code"]) == (status, status), error
    assert error["param"].startswith(param) and param in error["message"], error
    assert error["type"] and error["message"]


def test_chat_errors(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [{"type": "image"}]}]},
                  headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content")
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "top_logprobs": 2}, headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert http.get("/v1/nothing", headers=USER).status_code == 404


def test_auth(http, server):
    assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    wrong = {"Authorization": "Bearer wrong"}
    assert http.post("/v1/completions", json={"prompt": "x"}, headers=wrong).status_code == 401
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/version", "/metrics"):
        assert http.get(path).status_code == 200, path
    for method, path in [("DELETE", "/v1/steering/global"), ("POST", "/v1/capture/streams/hidden_states"),
                         ("GET", "/v1/capture/streams/hidden_states")]:
        assert http.request(method, path, headers=USER).status_code == 403
        assert http.request(method, path).status_code == 401
    r = http.request("DELETE", "/v1/steering/global", headers=ADMIN)
    assert r.status_code == 200
    assert http.get("/v1/models", headers=ADMIN).status_code == 200  # the admin key is a user key too
    assert http.get("/v1/steering", headers=USER).status_code == 200


def test_info_routes(http, offline):
    assert http.get("/version").json()["version"]
    card = http.get("/v1/models", headers=USER).json()["data"][0]
    assert (card["id"], card["hidden_size"], card["num_layers"], card["max_model_len"]) == (SERVED_NAME, 64, 3, 512)
    ids = offline.get_tokenizer()(PROMPTS[0]).input_ids
    r = http.post("/tokenize", json={"prompt": PROMPTS[0]}, headers=USER).json()
    assert r["tokens"] == ids and r["count"] == len(ids)
    chat = http.post("/tokenize", json={"messages": MESSAGES}, headers=USER).json()["tokens"]
    assert chat == offline.engine.tokenizer.apply_chat_template(MESSAGES)
    assert http.post("/detokenize", json={"tokens": ids}, headers=USER).json()["prompt"] == PROMPTS[0]
    assert http.post("/detokenize", json={"tokens": [10**6]}, headers=USER).status_code == 400


# ---------------------------------------------------------------- admin routes

def test_global_steering_changes_later_outputs_and_clearing_restores(client, offline, http):
    def completion():
        return client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                         extra_body={"return_token_ids": True}).choices[0].token_ids

    base = completion()
    v = vector(4)
    r = http.post("/v1/steering/global", json={"spec": {"post_attn": {"1": b64(v)}}, "replace": True}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["global"]["interventions"] == 1
    assert http.get("/v1/steering", headers=USER).json()["global"]["sites"] == ["post_attn:1"]
    steered = completion()
    offline.set_steering_vectors({"post_attn": {1: v}})
    try:
        ref = run_offline(offline, PROMPTS[2], max_tokens=10, temperature=0).outputs[0].token_ids
    finally:
        offline.clear_steering_vectors()
    assert steered == ref and steered != base
    assert http.post("/v1/steering/global", json={"spec": {"1": [0.0] * 64}, "replce": True},
                     headers=ADMIN).status_code == 400
    assert http.delete("/v1/steering/global", headers=ADMIN).json()["global"]["interventions"] == 0
    assert completion() == base


def test_capture_stream_routes(client, offline, http):
    path = "/v1/capture/streams/hidden_states"
    r = http.post(path, json={"layers": [1], "select": "last_prompt"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["enabled"]
    assert http.post(path, json={"layers": [1], "selct": "x"}, headers=ADMIN).status_code == 400
    ids, salts = [], [salt() for _ in PROMPTS[:3]]
    try:
        for prompt, cache_salt in zip(PROMPTS[:3], salts):
            ids.append(client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2, temperature=0,
                                                 extra_body={"cache_salt": cache_salt}).id)
        assert http.get(f"{path}/status", headers=USER).json()["rows_stored"] == {"1": 3}
        tensors, metas = deserialize_captured(http.get(path, params={"clear": "true"}, headers=ADMIN).json())
        assert http.get(f"{path}/status", headers=USER).json()["rows_stored"] == {"1": 0}
    finally:
        assert http.delete(path, headers=ADMIN).json()["enabled"] is False
    assert http.delete(f"{path}/rows", headers=ADMIN).status_code == 200
    assert http.get("/v1/capture/streams/nothing/status", headers=USER).status_code == 404
    for i, prompt in enumerate(PROMPTS[:3]):
        out = run_offline(offline, prompt, max_tokens=2, temperature=0, cache_salt=salts[i],
                          capture=CaptureSpec(layers=[1], select="last_prompt"))
        row = [j for j, label in enumerate(metas[1].req_ids) if match_capture_request_id(label, ids[i])]
        assert len(row) == 1 and torch.equal(tensors[1][row], out.captures["hidden_states"][1])


# ---------------------------------------------------------------- under load and faults

def test_metrics_have_the_prometheus_names(http):
    assert http.get("/v1/models").status_code == 401  # counted by status
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "steering_rows_in_use", "capture_rows_total", 'request_errors_total{status="401"}'):
        assert f"\nsteerable:{name}" in text, name


def test_prefix_cache_hits_across_http_requests(http):
    rng = random.Random(11)
    prefix = [rng.randrange(10, 300) for _ in range(96)]
    before = metrics(http)["steerable:prefix_cache_hits_total"]
    for tail in ([5, 6], [7, 8, 9]):
        r = http.post("/v1/completions", json={"prompt": prefix + tail, "max_tokens": 2}, headers=USER)
        assert r.status_code == 200
    assert metrics(http)["steerable:prefix_cache_hits_total"] - before >= 80


def test_client_disconnect_aborts_and_frees(http, server):
    before = metrics(http)["steerable:generation_tokens_total"]
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "ignore_eos": True, "capture": {"layers": [1]},
            "steering_vectors": {"1": [0.5] * 64}}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body,
                                                                      headers=USER) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break
    m = wait_idle(http)
    assert m["steerable:generation_tokens_total"] - before < 400
    assert_nothing_held(http)


def test_in_process_app_without_admin_key_and_after_shutdown(model_dirs):
    """The app on an AsyncLLM of this process (uvicorn in a thread): admin routes off without
    --admin-api-key, a model without a chat template, an error after streaming began, and 503
    once the engine is gone."""
    from steerable import AsyncLLM

    def fail() -> None:
        raise RuntimeError("injected step failure")

    llm = AsyncLLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024)
    with app_in_thread(llm) as c:
        r = c.delete("/v1/steering/global")
        assert r.status_code == 403 and "--admin-api-key" in r.json()["error"]["message"]
        body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 2:
                        llm.engine.step = fail  # a fault inside the engine's next step
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][5:])["error"]
        assert error["code"] == 503 and "injected step failure" in error["message"]
        llm.tokenizer.hf.chat_template = None
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert c.get("/health").status_code == 503


def test_serve_cli_help_and_flags_checked_before_loading(capsys):
    from steerable.entrypoints.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--admin-api-key", "--served-model-name", "--max-body-bytes",
                 "--max-capture-bytes", "--chat-template", "--dtype", "--device", "--max-num-seqs", "--max-model-len",
                 "--kv-cache-tokens", "--enforce-eager"):
        assert flag in help_text, flag
    port = str(free_port())  # the engine's flags are checked once the port is held
    for args, field in ((["--port", "0"], "--port"), (["--max-capture-bytes", "0"], "--max-capture-bytes"),
                        (["--api-key", ""], "--api-key"), (["--max-num-seqs", "0", "--port", port], "max_num_seqs")):
        assert main(["serve", "no-such-model", *args]) == 2
        assert field in capsys.readouterr().err


def test_chunked_body_over_the_limit_is_413(http):
    def body():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 2**16 + 1):
            yield b"z" * 2**16
        yield b'"}'

    r = http.post("/v1/completions", content=body(), headers={**USER, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def _control_vector_file(tmp_path, name: str, seed: int) -> str:
    from steerable.vectors import ControlVector
    path = str(tmp_path / name)
    ControlVector({1: vector(seed, 3.0), 2: vector(seed + 1, 3.0)}).save(path)
    return path


def test_module_from_a_control_vector_file(client, offline, http, tmp_path):
    """The module route takes a control-vector file's contents (base64), as llama.cpp users have them."""
    from steerable.vectors import ControlVector
    path = _control_vector_file(tmp_path, "happy.gguf", 40)
    data = base64.b64encode(open(path, "rb").read()).decode()
    r = http.post("/v1/steering/modules", json={"happy": {"control_vector": data, "scale": 0.5}}, headers=ADMIN)
    assert r.status_code == 200, r.text
    try:
        served = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                           extra_body={"steering_module_ref": "happy", "return_token_ids": True})
    finally:
        http.delete("/v1/steering/modules/happy", headers=ADMIN)
    ref = run_offline(offline, PROMPTS[1], max_tokens=8, temperature=0,
                      steering_vectors=ControlVector.load(path).to_spec(0.5)).outputs[0]
    plain = run_offline(offline, PROMPTS[1], max_tokens=8, temperature=0).outputs[0]
    assert served.choices[0].token_ids == ref.token_ids != plain.token_ids
    for bad, field in [({"control_vector": "%%%"}, "control_vector"),
                       ({"control_vector": base64.b64encode(b"not a vector file").decode()}, "control_vector"),
                       ({"control_vector": data, "strength": 1}, "strength")]:
        r = http.post("/v1/steering/modules", json={"bad": bad}, headers=ADMIN)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    assert "bad" not in http.get("/v1/steering/modules", headers=USER).json()["modules"]


def test_serve_control_vector_flags_set_the_global_default(model_dirs, offline, tmp_path):
    """``steerable serve --control-vector a.gguf:1.5 --control-vector b.gguf:-0.5`` steers every request
    with the per-layer sum, as ``llama-server`` does; it equals the summed spec set offline."""
    from server_harness import serve_test_model

    from steerable.vectors import combine_control_vectors
    a, b = _control_vector_file(tmp_path, "a.gguf", 50), _control_vector_file(tmp_path, "b.gguf", 60)
    flags = ["--control-vector", f"{a}:1.5", "--control-vector", f"{b}:-0.5"]
    with serve_test_model(model_dirs["qwen3"], str(tmp_path / "cv-server.log"), extra_args=flags) as running:
        with httpx.Client(base_url=running.url, timeout=60) as h:
            r = h.post("/v1/completions", headers=USER, json={"model": SERVED_NAME, "prompt": PROMPTS[2],
                                                               "max_tokens": 8, "temperature": 0,
                                                               "return_token_ids": True})
        children = _children(running.proc.pid)  # the engine runs in a process of its own
    assert r.status_code == 200, r.text
    assert sum("spawn_main" in cmdline for cmdline in children.values()) == 1, children
    deadline = time.monotonic() + 10  # after the server: no child of it left (multiprocessing's tracker too)
    while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], children
    offline.set_steering_vectors(combine_control_vectors([f"{a}:1.5", f"{b}:-0.5"]))
    try:
        ref = run_offline(offline, PROMPTS[2], max_tokens=8, temperature=0).outputs[0]
    finally:
        offline.clear_steering_vectors()
    plain = run_offline(offline, PROMPTS[2], max_tokens=8, temperature=0).outputs[0]
    assert r.json()["choices"][0]["token_ids"] == ref.token_ids != plain.token_ids


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` and their command lines (Linux ``/proc``)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read().replace("\0", " ")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children[int(entry)] = cmdline
    return children
