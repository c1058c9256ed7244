"""The SAE plane through ``steerable serve`` (the tiny Qwen3): ``--sae NAME=PATH[:LAYER[:HOOK]]``
registers SAEs at start; ``/v1/saes`` lists them (user key), registers and unregisters them
(admin key); the ``sae_features`` captures of a choice and of a capture stream, decoded from the
wire, equal the offline engine's bit for bit (indices, values, labels). Bad SAE input, on the
command line, in ``POST /v1/saes`` or in a request body, is refused naming the field or file; the
server keeps serving and holds nothing afterwards.

The server here is one of its own (the shared one starts without ``--sae``); every test of the
plane over HTTP shares it."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import httpx
import openai
import pytest
import torch
from conftest import PROMPTS
from server_harness import ADMIN, SERVED_NAME, USER, USER_KEY, assert_nothing_held, serve_test_model, wait_idle
from test_sae_registry import random_sae, save_saelens

from steerable import SAE, CaptureSpec, SamplingParams
from steerable.capture import deserialize_captured, match_capture_request_id
from steerable.capture.sparse import SparseFeatures
from steerable.steering.wire import steering_from_json

TOP_K = 8
D_SAE = 96  # random_sae's
AT_START = {"res1": {"layer": 1, "hook": "post_mlp", "d_sae": D_SAE, "architecture": "jumprelu"},
            "pre2": {"layer": 2, "hook": "pre_attn", "d_sae": D_SAE, "architecture": "jumprelu"}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """SAELens directories: good ones, one of another width, and damaged copies."""
    root = tmp_path_factory.mktemp("sae_server_files")
    out = {"res1": save_saelens(random_sae(layer=1, hook="post_mlp", apply_b_dec_to_input=True, seed=1), root / "res1"),
           "mid0": save_saelens(random_sae(architecture="topk", layer=0, hook="post_attn", seed=2), root / "mid0"),
           "narrow": save_saelens(random_sae(d_in=32, seed=3), root / "narrow")}
    truncated = shutil.copytree(out["res1"], root / "truncated")
    weights = truncated / "sae_weights.safetensors"
    weights.write_bytes(weights.read_bytes()[: os.path.getsize(weights) // 2])
    no_d_sae = shutil.copytree(out["res1"], root / "no_d_sae")
    cfg = json.loads((no_d_sae / "cfg.json").read_text())
    del cfg["d_sae"]
    (no_d_sae / "cfg.json").write_text(json.dumps(cfg))
    (root / "sae.pt").write_bytes(b"\x80\x04not really")
    return {**out, "truncated": str(truncated), "no_d_sae": str(no_d_sae), "pickle": str(root / "sae.pt")}


@pytest.fixture(scope="module")
def served(model_dirs, files, tmp_path_factory):
    """The same file twice: once where its hook name says, once at a site the flag gives."""
    flags = ["--sae", f"res1={files['res1']}", "--sae", f"pre2={files['res1']}:2:pre_attn"]
    log = str(tmp_path_factory.mktemp("sae_server") / "server.log")
    with serve_test_model(model_dirs["qwen3"], log, extra_args=flags) as running:
        yield running


@pytest.fixture(scope="module")
def api(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=USER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(offline, files):
    """The offline engine with the SAEs the server registered at start."""
    offline.register_sae("res1", SAE.load(files["res1"]))
    offline.register_sae("pre2", SAE.load(files["res1"], layer=2, hook="pre_attn"))
    return offline


def salt() -> str:
    return uuid.uuid4().hex


def listed(api: httpx.Client) -> dict:
    r = api.get("/v1/saes", headers=USER)
    assert r.status_code == 200, r.text
    return r.json()["saes"]


def test_serve_sae_flag_registers_at_start_and_steers(api, ref):
    assert listed(api) == ref.list_saes() == AT_START
    wire = {"features": [{"sae": "pre2", "index": 7, "scale": 4.0},
                         {"sae": "res1", "index": 3, "value": 3.0, "clamp": True}]}
    cache_salt = salt()
    r = api.post("/v1/completions", headers=USER, json={
        "model": SERVED_NAME, "prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "logprobs": 1,
        "steering_vectors": wire, "return_token_ids": True, "cache_salt": cache_salt})
    assert r.status_code == 200, r.text
    greedy = dict(max_tokens=8, temperature=0, logprobs=1)
    steered = ref.generate(PROMPTS[3], SamplingParams(**greedy, steering_vectors=steering_from_json(wire),
                                                      cache_salt=cache_salt), use_tqdm=False)[0].outputs[0]
    plain = ref.generate(PROMPTS[3], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == steered.token_ids != plain.token_ids
    assert choice["logprobs"]["token_logprobs"] == [steered.logprobs[i][t].logprob
                                                    for i, t in enumerate(steered.token_ids)]


@pytest.mark.parametrize("stream", [False, True])
def test_feature_captures_over_http_equal_offline(client, ref, stream):
    """Two sampled choices of a feature-steered request, each capturing two SAEs' features on
    every row (capture reads what steering wrote): the wire decodes to the offline features."""
    capture = {"stream": "sae_features", "saes": ["res1", "pre2"], "top_k": TOP_K, "select": "all"}
    steering = {"features": [{"sae": "res1", "index": 5, "scale": 3.0}]}
    kwargs = dict(max_tokens=6, temperature=0.9, seed=5, n=2)
    cache_salt = salt()
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], stream=stream, **kwargs, extra_body={
        "capture": capture, "steering_vectors": steering, "cache_salt": cache_salt})
    out = ref.generate(PROMPTS[1], SamplingParams(
        **kwargs, cache_salt=cache_salt, steering_vectors=steering_from_json(steering),
        capture=CaptureSpec(stream="sae_features", saes=["res1", "pre2"], top_k=TOP_K, select="all")),
        use_tqdm=False)[0]
    merged = out.captures["sae_features"]["res1"]  # the request's rows: its completions' in order
    assert merged == SparseFeatures.cat([c.captures["sae_features"]["res1"] for c in out.outputs])
    if stream:  # the captures ride on each choice's final chunk
        chunks = list(r)
        finals = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason is not None}
        choices, request_id = [finals[0], finals[1]], chunks[0].id
    else:
        choices, request_id = r.choices, r.id
    for choice, completion in zip(choices, out.outputs, strict=True):
        assert set(choice.captures) == {"sae_features"}
        tensors, metas = deserialize_captured(json.loads(json.dumps(choice.captures["sae_features"])))
        assert set(tensors) == {"res1", "pre2"}
        for name, features in tensors.items():
            offline, meta = completion.captures["sae_features"][name], completion.capture_meta["sae_features"][name]
            assert isinstance(features, SparseFeatures) and features.top_k == TOP_K
            assert features == offline  # indices and values, bit for bit
            assert metas[name].positions.tolist() == meta.positions.tolist() == list(
                range(len(out.prompt_token_ids) + len(completion.token_ids) - 1))
            assert metas[name].token_ids.tolist() == meta.token_ids.tolist()
            assert all(match_capture_request_id(label, request_id) for label in metas[name].req_ids)
            assert (features.indices >= 0).sum() > len(features)  # features fire: a no-op would not pass


def test_feature_stream_over_http_equals_offline(client, api, ref):
    """``/v1/capture/streams/sae_features``: started with SAE names, it holds its SAE (unregistering
    is refused naming the stream) and its rows decode to the offline request's."""
    path = "/v1/capture/streams/sae_features"
    r = api.post(path, json={"saes": ["pre2"], "top_k": TOP_K, "select": "all_prompt"}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["enabled"], r.text
    cache_salt = salt()
    try:
        refused = api.delete("/v1/saes/pre2", headers=ADMIN)
        assert refused.status_code == 400 and "in use by" in refused.json()["error"]["message"], refused.text
        request_id = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], max_tokens=2, temperature=0,
                                               extra_body={"cache_salt": cache_salt}).id
        tensors, metas = deserialize_captured(api.get(path, params={"clear": "true"}, headers=ADMIN).json())
    finally:
        assert api.delete(path, headers=ADMIN).json()["enabled"] is False
    spec = CaptureSpec(stream="sae_features", saes=["pre2"], top_k=TOP_K, select="all_prompt")
    out = ref.generate(PROMPTS[2], SamplingParams(max_tokens=2, temperature=0, cache_salt=cache_salt, capture=spec),
                       use_tqdm=False)[0]
    assert list(tensors) == ["pre2"]
    assert all(match_capture_request_id(label, request_id) for label in metas["pre2"].req_ids)
    assert tensors["pre2"] == out.captures["sae_features"]["pre2"]
    assert metas["pre2"].positions.tolist() == list(range(len(out.prompt_token_ids)))


def test_sae_routes_need_the_admin_key(api, files):
    for method, path, body in [("POST", "/v1/saes", {"x": {"path": files["mid0"]}}), ("DELETE", "/v1/saes/res1", None)]:
        assert api.request(method, path, json=body).status_code == 401
        assert api.request(method, path, json=body, headers=USER).status_code == 403
    assert api.get("/v1/saes").status_code == 401
    r = api.post("/v1/saes", headers=ADMIN, json={"mid0": {"path": files["mid0"]},
                                                  "res0": {"path": files["res1"], "layer": 0, "hook": "post_attn"}})
    assert r.status_code == 200, r.text
    assert r.json()["saes"] == {**AT_START, "mid0": {"layer": 0, "hook": "post_attn", "d_sae": D_SAE,
                                                     "architecture": "topk"},
                                "res0": {"layer": 0, "hook": "post_attn", "d_sae": D_SAE, "architecture": "jumprelu"}}
    for name in ("mid0", "res0"):
        assert api.delete(f"/v1/saes/{name}", headers=ADMIN).status_code == 200
    assert listed(api) == AT_START


BAD_REGISTRATIONS = [  # (body, paths naming the files fixture where they can; what the message must say)
    ({"x": {"path": "pickle"}}, ["saes['x']", "sae.pt", "never unpickled"]),
    ({"x": {"path": "truncated"}}, ["saes['x']", "sae_weights.safetensors: not a readable safetensors file"]),
    ({"x": {"path": "no_d_sae"}}, ["saes['x']", "cfg.json: missing field 'd_sae'"]),
    ({"x": {"path": "narrow"}}, ["saes['x']", "sae.d_in: 32 does not match the model's hidden size 64"]),
    ({"x": {"path": "res1", "layer": 7}}, ["saes['x']", "sae.layer: 7"]),
    ({"x": {"path": "res1", "layr": 1}}, ["saes['x'].layr: unknown key"]),
    ({"ok": {"path": "mid0"}, "x": {"path": "/nowhere"}}, ["saes['x']", "'/nowhere' does not exist"]),
    ({"ok": {"path": "mid0"}, "res1": {"path": "mid0"}}, ["saes['res1']", "registered already"]),  # ok rolled back
    ({}, ["body"]),
]


@pytest.mark.parametrize("body, says", BAD_REGISTRATIONS, ids=[str(i) for i in range(len(BAD_REGISTRATIONS))])
def test_bad_registrations_are_400s_and_register_nothing(api, files, body, says):
    body = {name: {**entry, "path": files.get(entry["path"], entry["path"])} for name, entry in body.items()}
    r = api.post("/v1/saes", json=body, headers=ADMIN)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] and all(part in error["message"] for part in says), error
    assert listed(api) == AT_START


BAD_BODIES = [  # (fields of a completion request, the field the error names)
    ({"capture": {"stream": "sae_features", "saes": ["nope"]}}, "capture.saes"),
    ({"capture": {"stream": "sae_features", "saes": ["res1"], "top_k": 0}}, "capture.top_k"),
    ({"capture": {"stream": "sae_features", "saes": ["res1"], "top_k": D_SAE + 1}}, "capture.top_k"),
    ({"capture": {"stream": "sae_features", "saes": ["res1"], "top_c": 8}}, "capture.top_c"),
    ({"steering_vectors": {"features": [{"sae": "nope", "index": 1}]}}, "steering_vectors.features[0].sae"),
    ({"steering_vectors": {"features": [{"sae": "res1", "index": D_SAE}]}}, "steering_vectors.features[0].index"),
]


def test_bad_sae_fields_in_a_body_are_400s_naming_them(api):
    for body, field in BAD_BODIES:
        r = api.post("/v1/completions", headers=USER, json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 3,
                                                            **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"].startswith(field) and field in error["message"], error
    assert_nothing_held(api)
    r = api.post("/v1/completions", headers=USER, json={"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]  # still serving


def test_unregister_is_refused_while_a_live_request_steers_with_it(api, files):
    body = {"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "steering_vectors": {"features": [{"sae": "pre2", "index": 4, "scale": 2.0}]}}
    with api.stream("POST", "/v1/completions", json=body, headers=USER) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):  # the request is live: its first token is out
                refused = api.delete("/v1/saes/pre2", headers=ADMIN)
                break
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith("name: SAE 'pre2' is in use by 1 live request")
    wait_idle(api)  # closing the stream aborted the request: now it may go
    assert api.delete("/v1/saes/pre2", headers=ADMIN).json()["saes"] == {"res1": AT_START["res1"]}
    assert api.delete("/v1/saes/pre2", headers=ADMIN).status_code == 400  # unknown now
    r = api.post("/v1/saes", headers=ADMIN, json={"pre2": {"path": files["res1"], "layer": 2, "hook": "pre_attn"}})
    assert r.status_code == 200 and r.json()["saes"] == AT_START


def test_bad_sae_flags_fail_before_the_model_loads(files, capsys):
    from steerable.entrypoints.cli import main

    for spec, says in [("res1", "expected NAME=PATH[:LAYER[:HOOK]]"),
                       (f"x={files['res1']}:pre_attn", "needs its layer")]:
        with pytest.raises(SystemExit):
            main(["serve", "no-such-model", "--sae", spec])
        err = capsys.readouterr().err
        assert "--sae" in err and says in err, err
    for spec, says in [(f"x={files['pickle']}", "never unpickled"), ("x=/nowhere", "'/nowhere' does not exist"),
                       (f"x={files['no_d_sae']}", "cfg.json: missing field 'd_sae'")]:
        assert main(["serve", "no-such-model", "--sae", spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --sae: ") and says in err, err


def test_an_sae_of_another_width_fails_at_start_naming_it(model_dirs, files, capsys, monkeypatch):
    """Its width is known only once the model is: the engine starts, refuses it, and stops (the
    engine in this process instead of one of its own, to keep the test short)."""
    from steerable import AsyncLLM
    from steerable.entrypoints import engine_process
    from steerable.entrypoints.cli import main

    started = []
    monkeypatch.setattr(engine_process, "ProcessAsyncLLM", lambda **kw: started.append(AsyncLLM(**kw)) or started[0])
    assert main(["serve", model_dirs["qwen3"], "--device", "cpu", "--kv-cache-tokens", "1024",
                 "--sae", f"narrow={files['narrow']}"]) == 2
    err = capsys.readouterr().err
    assert "error: --sae narrow: sae.d_in: 32 does not match the model's hidden size 64" in err, err
    assert len(started) == 1 and not started[0]._thread.is_alive()  # and it was shut down


def test_transcoders_over_http(api, client, ref, tmp_path):
    """``POST /v1/saes`` loads circuit-tracer transcoders (a set, one layer of it, a cross-layer one);
    a request steering with their features and capturing their features and error nodes decodes to
    the offline engine's, bit for bit; bad transcoder input is a 400 naming it."""
    from transcoder_helpers import random_transcoder, write_circuit_tracer_clt, write_circuit_tracer_set

    from steerable import Transcoder

    paths = {"set": write_circuit_tracer_set(random_transcoder(layers=3, layer=0, architecture="relu", seed=21),
                                             str(tmp_path / "set")),
             "clt": write_circuit_tracer_clt(random_transcoder(layers=3, layer=0, cross_layer=True, seed=22),
                                             str(tmp_path / "clt"))}
    body = {"set": {"path": paths["set"]}, "clt": {"path": paths["clt"]}, "one": {"path": paths["set"], "layer": 1}}
    r = api.post("/v1/saes", headers=ADMIN, json=body)
    assert r.status_code == 200, r.text
    for name, entry in body.items():
        ref.register_sae(name, Transcoder.load(entry["path"], entry.get("layer")))
    try:
        kinds = {name: info.get("kind") for name, info in r.json()["saes"].items()}
        assert kinds == {"res1": None, "pre2": None, "set": "transcoder_set", "clt": "cross_layer_transcoder",
                         "one": "transcoder"}
        steering = {"features": [{"sae": "clt", "index": 5, "scale": 2.0},
                                 {"sae": "set", "index": 60, "value": 3.0, "clamp": True}]}
        capture = [{"stream": "sae_features", "saes": ["clt", "set"], "top_k": TOP_K, "select": "all"},
                   {"stream": "transcoder_error", "saes": ["clt", "one"], "select": "all"}]
        cache_salt = salt()
        choice = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0,
                                           extra_body={"capture": capture, "steering_vectors": steering,
                                                       "cache_salt": cache_salt}).choices[0]
        specs = [CaptureSpec(stream="sae_features", saes=["clt", "set"], top_k=TOP_K, select="all"),
                 CaptureSpec(stream="transcoder_error", saes=["clt", "one"], select="all")]
        out = ref.generate(PROMPTS[1], SamplingParams(max_tokens=4, temperature=0, cache_salt=cache_salt, capture=specs,
                                                      steering_vectors=steering_from_json(steering)),
                           use_tqdm=False)[0]
        for component in ("sae_features", "transcoder_error"):
            tensors, metas = deserialize_captured(json.loads(json.dumps(choice.captures[component])))
            assert set(tensors) == set(out.captures[component])
            for name, rows in tensors.items():
                offline = out.captures[component][name]
                assert rows == offline if component == "sae_features" else torch.equal(rows, offline)
                assert metas[name].positions.tolist() == out.capture_meta[component][name].positions.tolist()
        assert out.captures["transcoder_error"]["clt"].shape[1:] == (3, 64)
        assert out.captures["transcoder_error"]["one"].shape[1:] == (64,)
        four = write_circuit_tracer_set(random_transcoder(layers=4, layer=0, seed=23), str(tmp_path / "four"))
        for entry, says in [({"path": paths["set"], "hook": "mlp_in"}, "holds a transcoder"),
                            ({"path": paths["set"], "layer": 7}, "has no transcoder for layer 7"),
                            ({"path": four}, "transcoder.layers: [0, 1, 2, 3] reach layer 3")]:
            r = api.post("/v1/saes", headers=ADMIN, json={"x": entry})
            assert r.status_code == 400 and "saes['x']" in r.json()["error"]["message"], r.text
            assert says in r.json()["error"]["message"], r.text
        r = api.post("/v1/completions", headers=USER, json={
            "model": SERVED_NAME, "prompt": "Hello", "max_tokens": 2,
            "capture": {"stream": "transcoder_error", "saes": ["res1"]}})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("capture.saes"), r.text
        assert_nothing_held(api)
    finally:
        for name in body:
            api.delete(f"/v1/saes/{name}", headers=ADMIN)
            ref.unregister_sae(name)
    assert listed(api) == AT_START
