"""vLLM compatibility, round 3 (issue 48 §1, 19-22): what an existing vLLM client still saw
differ, tool calls and reasoning through ``steerable serve`` (the ``openai`` client, raw HTTP where
the client hides a field), and the server's start and stop. The tiny model's own words are random,
so a regex held to a tool call's text (structured outputs) makes it write one: the engine
generates it token by token and the server's parser reads it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from server_harness import ROOT, SERVED_NAME, USER, USER_KEY, assert_nothing_held, serve_test_model

from steerable import CaptureSpec, SamplingParams, StructuredOutputsParams
from steerable.capture import deserialize_captured
from steerable.entrypoints.openai.launcher import free_port

PROMPT = "The quick brown fox jumps"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                                                          "required": ["city"]}}}]
# Hermes-style tools template (Qwen2.5's shape) for the tiny tokenizer's role tokens.
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>Tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\nCall one as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call></s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tools_server(model_dirs, tmp_path_factory):
    """The tiny model served with tool-call and reasoning parsing and prompt-token details."""
    folder = tmp_path_factory.mktemp("tools_server")
    (folder / "template.jinja").write_text(TOOLS_TEMPLATE)
    running = serve_test_model(model_dirs["qwen3"], str(folder / "server.log"), [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--enable-prompt-tokens-details", "--chat-template", str(folder / "template.jinja")])
    with running:
        yield running


@pytest.fixture(scope="module")
def tools_http(tools_server):
    with httpx.Client(base_url=tools_server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tools_client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def sse(http: httpx.Client, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}, headers=USER) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---------------------------------------------------------------- §1: the shapes a vLLM client reads

def test_prompt_token_ids_arrive_on_the_first_chunk(http, offline):
    ids = offline.get_tokenizer()(PROMPT).input_ids
    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "return_token_ids": True})
    firsts = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            firsts.setdefault(choice["index"], choice)
            if choice is not firsts[choice["index"]]:
                assert "prompt_token_ids" not in choice  # once per choice, first
    assert [firsts[k]["prompt_token_ids"] for k in (0, 1)] == [ids, ids]
    chat = sse(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "return_token_ids": True})
    templated = offline.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    assert chat[0]["prompt_token_ids"] == list(templated) and chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in c for c in chat[1:])


def test_every_chat_chunk_has_content_and_usage_needs_include_usage(client, http):
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].delta.content is not None
    assert "".join(c.choices[0].delta.content for c in chunks)  # concatenating never meets None
    for route, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        alone = sse(http, route, {**base, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}})
        assert all("usage" not in c for c in alone)  # vLLM: per-chunk usage only with include_usage too
        both = sse(http, route, {**base, "max_tokens": 3, "stream_options": {"continuous_usage_stats": True,
                                                                             "include_usage": True}})
        assert all("usage" in c for c in both) and both[-1]["choices"] == []


def test_top_logprobs_put_the_chosen_token_first(http, offline):
    # A seed whose sample leaves the top 2 somewhere, or the order would not show.
    for seed in range(50):
        ref = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=1.5, seed=seed, logprobs=2),
                               use_tqdm=False)[0].outputs[0]
        if any(entries[t].rank > 2 for t, entries in zip(ref.token_ids, ref.logprobs)):
            break
    else:
        pytest.fail("no seed samples outside the top 2")
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 1.5, "seed": seed,
                                           "logprobs": 2, "return_tokens_as_token_ids": True}, headers=USER).json()
    lp = r["choices"][0]["logprobs"]
    for token, tops, entries, chosen in zip(lp["tokens"], lp["top_logprobs"], ref.logprobs, ref.token_ids):
        keys = list(tops)  # token_id:N names: byte-level tokens may share a decoded text
        assert token == f"token_id:{chosen}" and keys[0] == token
        others = sorted((t for t, e in entries.items() if t != chosen and e.rank <= 2), key=lambda t: entries[t].rank)
        assert keys[1:] == [f"token_id:{t}" for t in others]
        assert len(keys) == (2 if entries[chosen].rank <= 2 else 3)
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 6, "temperature": 1.5,
                                                   "seed": seed, "logprobs": True, "top_logprobs": 2,
                                                   "return_tokens_as_token_ids": True},
                     headers=USER).json()
    for item in chat["choices"][0]["logprobs"]["content"]:
        assert item["top_logprobs"][0]["token"] == item["token"] and len(item["top_logprobs"]) == 2


def test_fields_vllm_always_serialises(http):
    for route, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES}),
                        ("/invocations", {"messages": MESSAGES})):
        r = http.post(route, json={**base, "max_tokens": 2, "temperature": 0}, headers=USER).json()
        for field in ("service_tier", "system_fingerprint", "kv_transfer_params"):
            assert field in r and r[field] is None, (route, field)
        assert r["usage"]["prompt_tokens_details"] is None  # without --enable-prompt-tokens-details
        if "message" in r["choices"][0]:
            message = r["choices"][0]["message"]
            assert message["tool_calls"] == [] and message["reasoning_content"] is None
            for field in ("refusal", "annotations", "audio", "function_call"):
                assert field in message and message[field] is None
    chat = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "seed": 1}
    a = http.post("/v1/chat/completions", json=chat, headers=USER).json()
    b = http.post("/invocations", json=chat, headers=USER).json()
    assert {k: v for k, v in a.items() if k not in ("id", "created")} == {
        k: v for k, v in b.items() if k not in ("id", "created")}


def test_cached_tokens_with_prompt_tokens_details(tools_http):
    long = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 6)
    body = {"prompt": long, "max_tokens": 2, "temperature": 0}
    first = tools_http.post("/v1/completions", json=body, headers=USER).json()["usage"]
    again = tools_http.post("/v1/completions", json=body, headers=USER).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0  # whole blocks, not the last token
    last = sse(tools_http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})[-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


def test_error_wording_clients_match(http):
    for seed, kind in ((2**63, "less_than_equal"), (-2**63 - 1, "greater_than_equal")):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "seed": seed}, headers=USER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed" and kind in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2}, headers=USER)
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"


# ---------------------------------------------------------------- §9: tool calls

def test_tool_call_parsed_whole_and_streamed(tools_client, tools_http):
    body = dict(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    r = tools_client.chat.completions.create(**body)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(tools_client.chat.completions.create(**body, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    opened = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
    assert len(opened) == 1 and opened[0].function.name == "get_weather" and opened[0].index == 0
    arguments = "".join(t.function.arguments or "" for d in deltas for t in (d.tool_calls or []))
    assert arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(d.content or "" for d in deltas)  # the call's text is not content
    # The call goes back to the model in the next turn through the template.
    follow = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = tools_http.post("/tokenize", json={"messages": follow, "tools": TOOLS}, headers=USER).json()
    text = tools_http.post("/detokenize", json={"tokens": r["tokens"]}, headers=USER).json()["prompt"]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "get_weather" in text.split("<|user|>")[0]  # the tools, rendered before the conversation


def test_forced_tool_choices_use_the_schemas(tools_client, tools_http):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = tools_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                             max_tokens=100, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome",
                                                                                                    "Oslo")
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "tool_calls"
    r = tools_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS,
                                             tool_choice="required", max_tokens=100, temperature=0)
    if r.choices[0].finish_reason == "tool_calls":  # the list may go on past max_tokens
        assert {c.function.name for c in r.choices[0].message.tool_calls} == {"get_weather"}
        assert all(c.id.startswith("chatcmpl-tool-") for c in r.choices[0].message.tool_calls)
    for body, param in (({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice.function.name"),
                        ({"tools": [{"type": "function"}]}, "tools[0]"),
                        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice")):
        r = tools_http.post("/v1/chat/completions", json={"messages": MESSAGES, **body}, headers=USER)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_auto_tool_choice_needs_the_flags(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2},
                  headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none",
                                                "max_tokens": 2}, headers=USER)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


def test_steering_and_capture_apply_to_tool_requests(tools_http, offline):
    """A named tool choice is an ordinary request held to a schema: it is steered as offline, and its
    capture rows are those of the real token positions."""
    from steerable.entrypoints.openai.tool_parsers.forced import parameters_schema

    hidden = offline.llm_engine.model_config.hidden_size
    vector = [4.0 if i % 3 == 0 else -2.0 for i in range(hidden)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "max_tokens": 40, "temperature": 0,
            "return_token_ids": True, "capture": {"layers": [1]}}
    ids = tools_http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}, headers=USER).json()["tokens"]
    captured = []
    for steer in (None, {0: vector}):
        wire = None if steer is None else {"0": vector}
        choice = tools_http.post("/v1/chat/completions", json={**body, "steering_vectors": wire},
                                 headers=USER).json()["choices"][0]
        schema = StructuredOutputsParams(json=parameters_schema(TOOLS[0]), disable_any_whitespace=True)
        ref = offline.generate(ids, SamplingParams(max_tokens=40, temperature=0, steering_vectors=steer,
                                                   structured_outputs=schema, capture=[CaptureSpec(layers=[1])]),
                               use_tqdm=False)[0].outputs[0]
        assert choice["token_ids"] == ref.token_ids and choice["message"]["tool_calls"]
        rows, meta = deserialize_captured(choice["captures"]["hidden_states"])
        assert meta[1].positions.tolist() == list(range(len(ids) + len(ref.token_ids) - 1))
        assert torch.equal(rows[1], ref.captures["hidden_states"][1].to(rows[1].dtype))
        captured.append(rows[1])
    assert not torch.equal(captured[0], captured[1])  # effect size: the steering reached the constrained request


# ---------------------------------------------------------------- §10: reasoning

def test_reasoning_split_and_capture_positions(tools_client, tools_http, offline):
    r = tools_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0)
    message = r.choices[0].message
    assert message.content is None and message.reasoning_content  # Qwen3 thinks by default: no </think> yet
    off = tools_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    regex = r"<think>\n[a-z ]{3,12}\n</think>\n\n[A-Z][a-z ]{3,12}"
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": regex},
            "capture": {"layers": [0]}, "return_token_ids": True}
    whole = tools_http.post("/v1/chat/completions", json=body, headers=USER).json()["choices"][0]
    text = offline.get_tokenizer().decode(whole["token_ids"], skip_special_tokens=True)
    reasoning, _, content = text.removeprefix("<think>").partition("</think>")
    assert whole["message"]["reasoning_content"] == reasoning and whole["message"]["content"] == content
    prompt = tools_http.post("/tokenize", json={"messages": MESSAGES}, headers=USER).json()["tokens"]
    rows, meta = deserialize_captured(whole["captures"]["hidden_states"])
    # Every token's row at its real position, the reasoning's included: the split is the text's only.
    assert meta[0].positions.tolist() == list(range(len(prompt) + len(whole["token_ids"]) - 1))
    chunks = sse(tools_http, "/v1/chat/completions", {k: v for k, v in body.items() if k != "capture"})
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in chunks:
        for key in streamed:
            streamed[key] += chunk["choices"][0]["delta"].get(key, "")
    assert streamed == {"reasoning_content": reasoning, "content": content}
    hidden = tools_http.post("/v1/chat/completions", json={**body, "include_reasoning": False},
                             headers=USER).json()
    assert hidden["choices"][0]["message"]["reasoning_content"] is None
    assert_nothing_held(tools_http)


# ---------------------------------------------------------------- §19-22: the server itself

def test_body_without_json_content_type_and_layer_keys(http):
    r = http.post("/v1/completions", content=json.dumps({"prompt": PROMPT}),
                  headers={**USER, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "steering_vectors": {"twelve": [1.0, 2.0]}},
                  headers=USER)
    assert r.status_code == 400 and "layer keys are integers" in r.json()["error"]["message"]


def test_swagger_ui_is_served_locally(http):
    for page, script in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = http.get(page).text
        assert script in html and "cdn." not in html and "https://" not in html.split("<body>")[1]
        src = html.split(script)[0].rsplit('"', 1)[1] + script
        asset = http.get(src)
        assert asset.status_code == 200 and len(asset.content) > 100_000


def test_port_in_use_fails_before_loading():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "steerable.entrypoints.cli", "serve", "/no/such/model",
                               "--port", str(port)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ROOT})
        elapsed = time.monotonic() - start
    assert done.returncode == 2 and "already in use" in done.stderr and "Traceback" not in done.stderr
    assert "/no/such/model" not in done.stderr  # nothing was loaded
    assert elapsed < 5, elapsed  # ~0.3 s alone (an interpreter start and the CLI's imports); loaded machines vary


def test_ctrl_c_prints_one_line(model_dirs, tmp_path):
    log = tmp_path / "server.log"
    running = serve_test_model(model_dirs["qwen3"], str(log), ["--log-level", "info"])
    with running:
        httpx.post(f"{running.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   headers=USER, timeout=60)
        before = log.read_text().splitlines()
        running.proc.send_signal(signal.SIGINT)
        assert running.proc.wait(timeout=60) == 0
    added = log.read_text().splitlines()[len(before):]
    assert added == ["steerable: stopped"], added  # no uvicorn lifecycle lines, no nanobind leak report
    assert free_port()  # the port machinery still works after a stop
