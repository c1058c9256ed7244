"""Regression (issue 9 §1): requests that stop on a stop token or a stop string, or are aborted,
deliver exactly their own input rows: the discarded row computed for the token that stopped them
never reaches an open stream or a per-request capture, and no reduction is left pending."""

import pytest
import torch

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.capture import HIDDEN_STATES, match_capture_request_id

LAYERS = [0, 2]
PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [90, 91]]


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def free_run(llm):
    """Each prompt's greedy continuation without stops: where its stop token and stop string sit."""
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    return [out.outputs[0] for out in outs]


def _stopping_params(free_run, capture=None):
    """Prompt i stops early in a different way: on a stop token id, on a stop string, by length."""
    params = []
    for i, completion in enumerate(free_run):
        kind = i % 3
        if kind == 0:  # the token sampled at step 3 (or its first occurrence) stops the request
            params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                         stop_token_ids=[completion.token_ids[3]], capture=capture))
        elif kind == 1 and completion.text.strip():
            stop = completion.text.strip()[:2]
            params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                         capture=capture))
        else:
            params.append(SamplingParams(max_tokens=2 + i, temperature=0, ignore_eos=True, capture=capture))
    return params


def _expected_rows(out):
    """Brute force: every token input, i.e. the prompt and every generated token but the last."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    return list(range(len(ids) - 1)), ids[:-1]


@pytest.mark.parametrize("reduce", ["all", "last", "mean"])
def test_open_stream_over_two_generates(llm, free_run, reduce):
    llm.start_capture(HIDDEN_STATES, layers=LAYERS, reduce=reduce)
    try:
        first = llm.generate(PROMPTS, _stopping_params(free_run), use_tqdm=False)
        second = llm.generate(PROMPTS[::-1], _stopping_params(free_run[::-1]), use_tqdm=False)
        assert llm.capture_status(HIDDEN_STATES)["pending_reductions"] == 0
        llm.stop_capture(HIDDEN_STATES)
        assert any(o.outputs[0].finish_reason == "stop" for o in first)
        tensors, meta = llm.fetch_captured(HIDDEN_STATES)
    finally:
        llm.stop_capture(HIDDEN_STATES)
        llm.clear_captured(HIDDEN_STATES)
    # The rows of a sequence are a function of its tokens: prefilling every input once is the reference.
    reference = llm.generate([_expected_rows(out)[1] for out in first + second],
                             SamplingParams(max_tokens=1, capture=CaptureSpec(layers=LAYERS)), use_tqdm=False)
    for layer in LAYERS:
        labels = meta[layer]
        for out, ref in zip(first + second, reference):
            rows = [j for j, rid in enumerate(labels.req_ids) if match_capture_request_id(rid, out.request_id)]
            positions, token_ids = _expected_rows(out)
            ref_rows = ref.captures[HIDDEN_STATES][layer][:len(positions)]
            if reduce == "all":
                assert labels.positions[rows].tolist() == positions
                assert labels.token_ids[rows].tolist() == token_ids
                assert torch.allclose(tensors[layer][rows], ref_rows, rtol=1e-5, atol=1e-5)
            elif reduce == "last":
                assert len(rows) == 1
                assert labels.positions[rows].tolist() == positions[-1:]
                assert labels.token_ids[rows].tolist() == token_ids[-1:]
                assert torch.allclose(tensors[layer][rows], ref_rows[-1:], rtol=1e-5, atol=1e-5)
            else:
                assert len(rows) == 1
                assert torch.allclose(tensors[layer][rows], ref_rows.float().mean(0, keepdim=True), rtol=1e-5, atol=1e-5)


def test_per_request_captures_of_stopped_requests(llm, free_run):
    outs = llm.generate(PROMPTS, _stopping_params(free_run, CaptureSpec(layers=LAYERS)), use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in outs} >= {"stop", "length"}
    for out in outs:
        positions, token_ids = _expected_rows(out)
        for layer in LAYERS:
            meta = out.capture_meta[HIDDEN_STATES][layer]
            assert meta.positions.tolist() == positions and meta.token_ids.tolist() == token_ids
            assert out.captures[HIDDEN_STATES][layer].shape[0] == len(positions)


def test_aborted_request_with_a_row_in_flight(llm):
    engine = llm.llm_engine
    llm.start_capture(HIDDEN_STATES, layers=LAYERS, reduce="last")
    try:
        engine.add_request("keep", [5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        engine.add_request("drop", [9, 10, 11], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.abort_request("drop")  # its latest step is still in flight
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.capture_status(HIDDEN_STATES)["pending_reductions"] == 0
        llm.stop_capture(HIDDEN_STATES)
        _, meta = llm.fetch_captured(HIDDEN_STATES)
        assert not any(match_capture_request_id(rid, "drop") for rid in meta[LAYERS[0]].req_ids)
        assert sum(match_capture_request_id(rid, "keep") for rid in meta[LAYERS[0]].req_ids) == 1
    finally:
        llm.stop_capture(HIDDEN_STATES)
        llm.clear_captured(HIDDEN_STATES)


def test_generate_leaves_no_step_in_flight(llm, free_run):
    llm.generate(PROMPTS, _stopping_params(free_run), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
