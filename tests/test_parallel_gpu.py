"""GPU, two devices: TP=2 and PP=2 over NCCL with CUDA graphs on, in float32, against one GPU. One
batch carries 32 distinct steering configs, a stream and per-request captures (attention heads
gathered inside graphs) and requests that capture nothing; decode steps replay graphs on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PROMPTS
from test_parallel import _max_abs_diff, _rows_by_prompt, _steer, _steering_batch

from steerable import LLM, CaptureSpec
from steerable.capture import ATTENTION_HEADS, HIDDEN_STATES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
LOGPROB_TOL = 1e-3  # float32 without TF32, reductions in another order
CAPTURE_TOL = 1e-4


def _engine(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192, **kw)


@pytest.fixture(scope="module")
def single(capture_dirs) -> LLM:
    return _engine(capture_dirs["llama"])


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel(request, capture_dirs):
    tp, pp = LAYOUTS[request.param]
    llm = _engine(capture_dirs["llama"], tensor_parallel_size=tp, pipeline_parallel_size=pp)
    yield llm
    llm.shutdown()


def _run(llm: LLM):
    """32 steered requests; a third capture nothing, a third their attention heads, a third their
    hidden states at post_mlp; a stream records post_attn rows of all of them."""
    num_layers = llm.engine.model_config.num_layers
    captures = [None, CaptureSpec(ATTENTION_HEADS, select="all"), CaptureSpec(select="all_generated")]
    params = [dataclasses.replace(p, max_tokens=12, capture=captures[i % 3])
              for i, p in enumerate(_steering_batch(num_layers))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    llm.start_capture(HIDDEN_STATES, hook="post_attn", select="all_generated")
    try:
        outs, _ = _steer(llm, prompts, params)
        fetched = llm.fetch_captured(HIDDEN_STATES)
    finally:
        llm.stop_capture(HIDDEN_STATES)
    return outs, fetched


def test_steering_and_capture_match_one_gpu_under_graphs(parallel, single):
    outs, fetched = _run(parallel)
    refs, ref_fetched = _run(single)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    for out, ref in zip(outs, refs):
        for x, y in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) <= LOGPROB_TOL
        assert out.captures.keys() == ref.captures.keys()
        for stream, layers in ref.captures.items():
            for layer, value in layers.items():
                assert out.capture_meta[stream][layer].positions.tolist() == \
                    ref.capture_meta[stream][layer].positions.tolist()
                assert _max_abs_diff(out.captures[stream][layer], value) <= CAPTURE_TOL
    ours, theirs = _rows_by_prompt(outs, *fetched), _rows_by_prompt(refs, *ref_fetched)
    assert ours.keys() == theirs.keys()
    for key, (positions, tokens, values) in theirs.items():
        assert ours[key][:2] == (positions, tokens) and _max_abs_diff(ours[key][2], values) <= CAPTURE_TOL
    assert parallel.engine.stats()["graph_replays"] > 0  # decode steps ran from graphs, with capture inside
