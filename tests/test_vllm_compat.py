"""vLLM compatibility, round 2 (issue 28): the request fields and response shapes an existing vLLM
client relies on, driven through the shared ``steerable serve`` with ``openai`` and ``httpx`` and
compared with the offline engine (whose prompt logprobs ``test_prompt_logprobs`` checks against HF)."""

from __future__ import annotations

import math

import openai
import pytest
from server_harness import SERVED_NAME, USER, USER_KEY

from steerable import SamplingParams
from steerable.errors import InvalidRequestError

PROMPT = "The quick brown fox jumps"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def offline_one(offline, prompt, **kwargs):
    return offline.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def test_streaming_n_sends_one_choice_per_chunk(client, offline):
    ref = offline_one(offline, PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11)
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0,
                                       seed=11, stream=True)
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert [texts[i] for i in range(3)] == [c.text for c in ref.outputs]
    assert len(set(texts.values())) > 1  # the samples differ: each chunk really is its own choice's
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, n=2, max_tokens=4, temperature=0,
                                          stream=True, stream_options={"include_usage": True,
                                                                       "continuous_usage_stats": True})
    chunks = list(chat)
    assert all(len(c.choices) == 1 for c in chunks[:-1]) and chunks[-1].choices == []
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 8
    assert chunks[0].usage.completion_tokens == 0 < chunks[-2].usage.completion_tokens


def test_prompt_logprobs_on_the_choice_equal_offline(http, offline):
    ids = offline.get_tokenizer()(PROMPT).input_ids
    ref = offline_one(offline, PROMPT, max_tokens=2, temperature=0, prompt_logprobs=2)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 2}, headers=USER).json()
    choice = r["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(ids)
    for got, want in zip(choice["prompt_logprobs"][1:], ref.prompt_logprobs[1:]):
        assert {int(t) for t in got} == set(want)
        for t, entry in got.items():
            assert math.isclose(entry["logprob"], want[int(t)].logprob, abs_tol=1e-6)
            assert entry["rank"] == want[int(t)].rank and entry["decoded_token"] == want[int(t)].decoded_token
    assert choice["prompt_token_ids"] is None and choice["token_ids"] is None  # as vLLM: null unless asked
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1,
                                                   "return_token_ids": True}, headers=USER).json()
    templated = offline.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False)
    assert chat["prompt_token_ids"] == list(templated) and "prompt_token_ids" not in chat["choices"][0]
    assert len(chat["prompt_logprobs"]) == len(templated) and chat["choices"][0]["token_ids"]
    for bad in (-1, "x"):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": bad}, headers=USER)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """lm-eval-harness's local-completions loglikelihood request."""
    ids = offline.get_tokenizer()(PROMPT).input_ids
    ref = offline_one(offline, PROMPT, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT + ref.outputs[0].text
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(lp.token_logprobs[1:len(ids)], want))
    assert math.isclose(lp.token_logprobs[-1], ref.outputs[0].logprobs[0][ref.outputs[0].token_ids[0]].logprob,
                        abs_tol=1e-6)
    assert "".join(lp.tokens[:len(ids)]) == PROMPT and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == PROMPT + offline_one(offline, PROMPT, max_tokens=3,
                                                                              temperature=0).outputs[0].text


def test_logit_bias_and_allowed_tokens(http, offline):
    plain = offline_one(offline, PROMPT, max_tokens=4, temperature=0)
    target = 123 if plain.outputs[0].token_ids[0] != 123 else 124
    ref = offline_one(offline, PROMPT, max_tokens=4, temperature=0, logit_bias={target: 100})
    assert ref.outputs[0].token_ids == [target] * 4  # effect size: the bias decides every token
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                           "logit_bias": {str(target): 100}, "return_token_ids": True},
                  headers=USER).json()
    assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    allowed = offline_one(offline, PROMPT, max_tokens=5, temperature=1.0, seed=1, allowed_token_ids=[7, 9])
    assert set(allowed.outputs[0].token_ids) <= {7, 9}
    for body, param in (({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"abc": 1}}, "logit_bias"),
                        ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"seed": 2**63}, "seed"),
                        ({"stop_token_ids": [10**7]}, "stop_token_ids")):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body}, headers=USER)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_truncation_token_ids_and_stop_str(http, offline):
    ids = offline.get_tokenizer()(PROMPT).input_ids
    for side, kept in (("left", ids[-3:]), ("right", ids[:3])):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                               "truncate_prompt_tokens": 3, "truncation_side": side,
                                               "return_token_ids": True}, headers=USER).json()
        ref = offline_one(offline, kept, max_tokens=3, temperature=0)
        assert r["choices"][0]["prompt_token_ids"] == kept and r["usage"]["prompt_tokens"] == 3
        assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids
    offline_truncated = offline_one(offline, PROMPT, max_tokens=3, temperature=0, truncate_prompt_tokens=3)
    assert offline_truncated.prompt_token_ids == ids[-3:]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "logprobs": 1,
                                           "return_tokens_as_token_ids": True, "return_token_ids": True},
                  headers=USER).json()
    assert r["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    full = offline_one(offline, PROMPT, max_tokens=6, temperature=0, ignore_eos=True).outputs[0].text
    stop = full[2:4]
    ref = offline_one(offline, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, stop=[stop],
                      include_stop_str_in_output=True).outputs[0]
    assert ref.text.endswith(stop) and ref.finish_reason == "stop"
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                           "stop": [stop], "include_stop_str_in_output": True}, headers=USER).json()
    assert r["choices"][0]["text"] == ref.text


def test_stream_options_without_stream_and_bad_guided_fields_are_refused(http):
    """Guided fields work (tests/test_structured_outputs.py); a bad one is a 400 naming it."""
    cases = [({"stream_options": {"include_usage": True}}, "stream_options"),
             ({"guided_json": "{not json"}, "guided_json"), ({"guided_choice": []}, "guided_choice"),
             ({"guided_regex": "(unclosed"}, "guided_regex"), ({"guided_grammar": "root ::= "}, "guided_grammar"),
             ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
             ({"structured_outputs": {"regex": "[a"}}, "structured_outputs.regex"),
             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
             ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
             ({"response_format": {"type": "yaml"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.schema"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
              "response_format.json_schema.schema")]
    for body, param in cases:
        for route, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
            r = http.post(route, json={**base, "max_tokens": 2, **body}, headers=USER)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, r.json())
            assert "/project/" not in r.json()["error"]["message"] and ".cc:" not in r.json()["error"]["message"]


def test_chat_continue_final_message_tools_and_echo(http, offline):
    tokenizer = offline.get_tokenizer()
    open_turn = [*MESSAGES, {"role": "assistant", "content": "I am"}]
    want = tokenizer.apply_chat_template(open_turn, continue_final_message=True, tokenize=True, return_dict=False)
    r = http.post("/tokenize", json={"messages": open_turn, "add_generation_prompt": False,
                                     "continue_final_message": True, "return_token_strs": True}, headers=USER).json()
    assert r["tokens"] == list(want) and r["token_strs"] == tokenizer.convert_ids_to_tokens(list(want))
    closed = tokenizer.apply_chat_template(open_turn, tokenize=True, return_dict=False)
    assert list(closed) != list(want)  # effect size: the turn really stays open
    assert http.post("/tokenize", json={"prompt": "hi"}, headers=USER).json()["token_strs"] is None
    ref = offline_one(offline, list(want), max_tokens=4, temperature=0)
    r = http.post("/v1/chat/completions", json={"messages": open_turn, "add_generation_prompt": False,
                                                "continue_final_message": True, "echo": True, "max_tokens": 4,
                                                "temperature": 0}, headers=USER).json()
    assert r["choices"][0]["message"]["content"] == "I am" + ref.outputs[0].text
    tools = [{"type": "function", "function": {"name": "get_time", "description": "the time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with_tools = tokenizer.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    r = http.post("/tokenize", json={"messages": MESSAGES, "tools": tools}, headers=USER).json()
    assert r["tokens"] == list(with_tools)
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools, "tool_choice": "none",
                                                "max_tokens": 2, "return_token_ids": True}, headers=USER)
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == list(with_tools)
    # "auto" needs --enable-auto-tool-choice, as on vLLM (tests/test_vllm_compat3.py serves with it).
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools, "tool_choice": "auto"},
                  headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_invocations_route(http, offline):
    ref = offline_one(offline, PROMPT, max_tokens=3, temperature=0)
    r = http.post("/invocations", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}, headers=USER)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.outputs[0].text
    r = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 2}, headers=USER).json()
    assert r["object"] == "chat.completion"
    r = http.post("/invocations", json={"prompt": PROMPT, "n": "x"}, headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


@pytest.mark.parametrize("field, value", [("best_of", 3), ("guided_decoding", {"regex": ""}),
                                          ("structured_outputs", {"choice": []}), ("bad_words", ["x"]),
                                          ("spaces_between_special_tokens", False), ("prompt_logprobs", -1),
                                          ("truncate_prompt_tokens", 0), ("logit_bias", {1: 200}),
                                          ("allowed_token_ids", [])])
def test_offline_fields_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_offline_prompt_types_chat_prompt_and_version(offline):
    from steerable.inputs import TextPrompt, TokensPrompt

    ids = offline.get_tokenizer()(PROMPT).input_ids
    a, b = offline.generate([TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids)],
                            SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and b.prompt_token_ids == ids
    out = offline.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == offline.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                      tokenize=False)
    from steerable.entrypoints.cli import main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"], ["--version"]])
def test_cli_help_answers_before_importing_torch(argv):
    import subprocess
    import sys
    import time

    code = ("import sys, runpy; sys.argv = ['steerable', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('steerable.entrypoints.cli', run_name='__main__')\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - start < 5  # about 0.3 s alone; generous on a loaded 2-core machine
    assert "steerable" in done.stdout
