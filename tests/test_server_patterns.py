"""Attention patterns through ``steerable serve`` (issue 29): a pattern capture in a completions or
chat body comes back on the choice as the ragged wire format, which decodes to the offline
engine's ``AttentionPatterns`` bit for bit (values, heads, key ranges, labels), streamed or not;
patterns are no stream; a request whose patterns could exceed ``--max-capture-bytes`` is refused
with a 400 naming ``capture`` and the server keeps serving, holding nothing."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
import torch
from server_harness import ADMIN, MAX_CAPTURE_BYTES, SERVED_NAME, USER, USER_KEY, assert_nothing_held

from steerable import CaptureSpec, SamplingParams, SelectSpec
from steerable.capture import ATTENTION_PATTERNS, AttentionPatterns, deserialize_captured, match_capture_request_id

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]
TOKENS = 4
# Two layers, two heads given out of order (kept in head order), prompt rows and every generated one.
SELECT = {"prompt_positions": [0, -1], "generation": "all"}
PATTERNS_WIRE = {"component": ATTENTION_PATTERNS, "layers": [0, 2], "heads": [3, 1], "select": SELECT}
PATTERNS_SPEC = CaptureSpec(stream=ATTENTION_PATTERNS, layers=[0, 2], heads=[3, 1], select=SelectSpec(**SELECT))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=USER_KEY, max_retries=0, timeout=60)


def assert_patterns_equal(wire: dict, completion, request_id: str, prompt_len: int) -> None:
    """The choice's decoded patterns equal the offline completion's exactly, labels included."""
    assert set(wire) == {ATTENTION_PATTERNS}
    got, metas = deserialize_captured(json.loads(json.dumps(wire[ATTENTION_PATTERNS])))  # JSON as it came
    ref, ref_metas = completion.captures[ATTENTION_PATTERNS], completion.capture_meta[ATTENTION_PATTERNS]
    assert set(got) == set(ref) == {0, 2}
    for layer, pat in got.items():
        want, meta = ref[layer], ref_metas[layer]
        assert isinstance(pat, AttentionPatterns) and pat.heads == want.heads == [1, 3]
        assert torch.equal(pat.key_starts, want.key_starts) and torch.equal(pat.key_lens, want.key_lens)
        assert len(pat) == len(want) == len(meta) > 0
        for row, want_row in zip(pat.rows, want.rows):
            assert row.dtype == want_row.dtype == torch.float32 and torch.equal(row, want_row)
        assert torch.equal(metas[layer].positions, meta.positions)
        assert torch.equal(metas[layer].token_ids, meta.token_ids)
        assert all(match_capture_request_id(label, request_id) for label in metas[layer].req_ids)
        assert meta.positions.tolist() == [0, *range(prompt_len - 1, prompt_len + TOKENS - 1)]
        # Effect size: real distributions that attend somewhere in particular, not uniform rows.
        assert torch.allclose(want.rows[-1].sum(-1), torch.ones(2), atol=1e-5)
        assert (want.rows[-1] - 1 / want.rows[-1].shape[1]).abs().max() > 1e-3


def offline_ref(offline, prompt, cache_salt: str, chat: bool = False, **kwargs):
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, capture=PATTERNS_SPEC, cache_salt=cache_salt, **kwargs)
    return (offline.chat(prompt, params, use_tqdm=False) if chat else
            offline.generate(prompt, params, use_tqdm=False))[0]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_patterns_equal_offline_bit_for_bit(client, offline, stream):
    cache_salt = uuid.uuid4().hex
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=TOKENS, temperature=0.9, seed=5, n=2,
                                  stream=stream, extra_body={"capture": PATTERNS_WIRE, "cache_salt": cache_salt,
                                                             "ignore_eos": True})
    ref = offline_ref(offline, PROMPT, cache_salt, temperature=0.9, seed=5, n=2)
    if stream:  # the captures ride on each choice's final chunk
        chunks = list(r)
        finals = {c.index: c for chunk in chunks for c in chunk.choices if c.finish_reason is not None}
        choices, request_id = [finals[0], finals[1]], chunks[0].id
    else:
        choices, request_id = r.choices, r.id
    for choice, completion in zip(choices, ref.outputs):
        assert_patterns_equal(choice.captures, completion, request_id, len(ref.prompt_token_ids))
    assert ref.outputs[0].token_ids != ref.outputs[1].token_ids  # two sampled choices, two sets of rows


@pytest.mark.parametrize("stream", [False, True])
def test_chat_patterns_equal_offline_bit_for_bit(client, offline, stream):
    cache_salt = uuid.uuid4().hex
    r = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=TOKENS, temperature=0,
                                       stream=stream, extra_body={"capture": PATTERNS_WIRE, "cache_salt": cache_salt,
                                                                  "ignore_eos": True})
    ref = offline_ref(offline, MESSAGES, cache_salt, chat=True, temperature=0)
    if stream:
        chunks = list(r)
        choice = next(c for chunk in chunks for c in chunk.choices if c.finish_reason is not None)
        request_id = chunks[0].id
    else:
        choice, request_id = r.choices[0], r.id
    assert_patterns_equal(choice.captures, ref.outputs[0], request_id, len(ref.prompt_token_ids))


def test_patterns_are_not_a_stream(http):
    r = http.post(f"/v1/capture/streams/{ATTENTION_PATTERNS}", json={}, headers=ADMIN)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.json()
    assert http.get(f"/v1/capture/streams/{ATTENTION_PATTERNS}/status", headers=USER).status_code == 200


def test_oversize_patterns_get_400_and_the_server_keeps_serving(http):
    # Bound: rows (prompt + max_tokens - 1) x 3 layers x 4 heads x keys (prompt + max_tokens) x 4 bytes.
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 100,
            "capture": {"component": ATTENTION_PATTERNS, "select": "all"}}
    r = http.post("/v1/completions", json=body, headers=USER)
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["type"], error["param"]) == (400, 400, "BadRequestError", "capture")
    assert f"--max-capture-bytes={MAX_CAPTURE_BYTES}" in error["message"]
    chat = {key: value for key, value in body.items() if key != "prompt"}
    r = http.post("/v1/chat/completions", json={**chat, "messages": MESSAGES}, headers=USER)
    assert r.status_code == 400 and r.json()["error"]["param"] == "capture"
    # The same capture over fewer rows fits: answered, and nothing is left held.
    small = {**body, "max_tokens": 2, "capture": {**body["capture"], "select": "last_prompt", "layers": [1]}}
    r = http.post("/v1/completions", json=small, headers=USER)
    assert r.status_code == 200, r.text
    pats, _ = deserialize_captured(r.json()["choices"][0]["captures"][ATTENTION_PATTERNS])
    assert len(pats[1]) == 1 and pats[1].heads == [0, 1, 2, 3]
    assert_nothing_held(http)
