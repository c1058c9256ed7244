"""Shared-prefix attention through the engine, on a CPU under Triton's interpreter (the GPU path's
kernels): requests that hit the prefix cache share its blocks, decode steps read them once, and the
outputs equal an engine with the feature off (and HF greedy): tokens exactly, logprobs to 1e-5, as
numpy's matmul under the interpreter rounds a row by its tile's row count (on a GPU the two are
bit-identical: ``test_shared_prefix_gpu.py``). The engines here run a few rows, so the split-KV
limit is set to 0: every decode batch takes the unified kernel, as batches past the limit do, and
shares (one test keeps the limit: below it only mixed steps share). Run with ``TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1 -m triton``."""

import os

import numpy as np
import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1", allow_module_level=True)

from conftest import hf_greedy, hf_model  # noqa: E402
from graph_harness import EagerGraphs  # noqa: E402

from steerable import LLM, SamplingParams, SteeringSpec  # noqa: E402
from steerable.layers.attention_backends import triton_paged  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def unified_decode(monkeypatch):
    monkeypatch.setattr(triton_paged.CONFIG, "split_kv_max_programs", 0)


PREFIX = list(range(5, 45))  # 40 tokens: two whole blocks of 16 shared, the rest mid-block and private


def _engine(path: str, shared: bool, max_num_seqs: int = 3) -> LLM:
    return LLM(path, device="cpu", dtype="float32", kv_cache_tokens=2048, attention_backend="triton",
               max_num_seqs=max_num_seqs,
               enable_shared_prefix_attention=shared, shared_prefix_min_tokens=16, shared_prefix_min_requests=2)


def _same_logprobs(on, off) -> None:
    for a, b in zip(on.outputs[0].logprobs, off.outputs[0].logprobs):
        assert a.keys() == b.keys()
        for token, entry in b.items():
            assert abs(a[token].logprob - entry.logprob) <= 1e-5


def _run(llm: LLM, steer: list[float]) -> list:
    greedy = dict(temperature=0, ignore_eos=True, logprobs=2)
    llm.generate([PREFIX + [50]], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)  # the prefix is cached
    prompts = [PREFIX + list(range(60, 60 + n)) for n in (1, 9, 20, 2)]
    # Four requests through three rows: short ones leave the group and the waiting ones join it; the
    # steered one's prefix blocks hash differently (steering touches the prefix), so it holds its own.
    params = [SamplingParams(max_tokens=m, **greedy) for m in (2, 4, 2)]
    params.append(SamplingParams(max_tokens=2, steering_vectors=SteeringSpec(vectors={"pre_attn": {1: steer}}),
                                 **greedy))
    return llm.generate(prompts, params, use_tqdm=False)


def test_outputs_equal_unshared_engine_and_hf(model_dirs):
    """Gemma 3: its full-attention layers share the prefix, its sliding-window layers take the plain kernel."""
    path = model_dirs["gemma3"]
    steer = (np.random.default_rng(0).standard_normal(64) * 2).tolist()
    outs = {}
    for shared in (True, False):
        llm = _engine(path, shared)
        outs[shared] = _run(llm, steer)
        stats = llm.llm_engine.stats()
        assert (stats["shared_prefix_steps"] > 0) == shared
        llm.shutdown()
    for on, off in zip(outs[True], outs[False]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        _same_logprobs(on, off)
    hf = hf_model(path)
    first = outs[True][1]
    assert first.outputs[0].token_ids == hf_greedy(hf, list(first.prompt_token_ids), 4)


def _recording(llm: LLM) -> list:
    """Wrap the worker's launch to record (max_query_len, shares a prefix) of every step."""
    worker = llm.llm_engine.worker
    launch, seen = worker.launch, []

    def recorded(step):
        seen.append((step.max_query_len, step.shared_prefix is not None))
        return launch(step)

    worker.launch = recorded
    return seen


def _run_mixed(llm: LLM) -> list:
    """Three long decodes and a short one share the cached prefix; when the short one ends, a fifth
    request's prefill joins the three decode rows in one step."""
    greedy = dict(temperature=0, ignore_eos=True, logprobs=2)
    llm.generate([PREFIX + [50]], SamplingParams(max_tokens=1, **greedy), use_tqdm=False)
    prompts = [PREFIX + list(range(60, 60 + n)) for n in (1, 3, 5, 2, 11)]
    params = [SamplingParams(max_tokens=m, **greedy) for m in (6, 6, 6, 2, 3)]
    return llm.generate(prompts, params, use_tqdm=False)


def test_mixed_steps_share_and_pad(model_dirs):
    """Steps that mix a new request's prefill with decode rows share the prefix among their decode
    rows, padded as the graph runner pads them (mixed steps to the mixed ladder and one sequence
    more, decode steps to the decode ladder), and equal an engine without sharing padded the same way."""
    path = model_dirs["qwen3"]
    llm = _engine(path, True, max_num_seqs=4)
    graphs = llm.llm_engine.worker.graphs = EagerGraphs(4, 256)
    seen = _recording(llm)
    got = _run_mixed(llm)
    llm.shutdown()
    assert any(q > 1 and shared for q, shared in seen), seen
    plain = _engine(path, False, max_num_seqs=4)
    plain.llm_engine.worker.graphs = EagerGraphs(4, 256)  # the same padded shapes: the same GEMMs
    expected = _run_mixed(plain)
    plain.shutdown()
    for on, off in zip(got, expected):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        _same_logprobs(on, off)
    keys = graphs.keys
    assert any(key[5] for key in keys) and any(not key[5] for key in keys)  # mixed and decode shapes
    assert any(key[4] and key[5] for key in keys)  # a mixed step that shares, padded


def test_decode_steps_below_the_split_kv_limit_do_not_share(model_dirs, monkeypatch):
    """With the shipped limit, a few decode rows take split-KV, whose per-row segments no shared pass
    reproduces: the step builder still finds their group, the runner runs them unshared, and only the
    mixed steps (always the unified kernel) share."""
    monkeypatch.setattr(triton_paged.CONFIG, "split_kv_max_programs", 128)
    llm = _engine(model_dirs["qwen3"], True, max_num_seqs=4)
    seen = _recording(llm)
    got = _run_mixed(llm)
    shared_steps = llm.llm_engine.stats()["shared_prefix_steps"]
    llm.shutdown()
    assert any(q == 1 and found for q, found in seen)  # decode steps with a group
    assert shared_steps == sum(q > 1 and found for q, found in seen) > 0
    plain = _engine(model_dirs["qwen3"], False, max_num_seqs=4)
    expected = _run_mixed(plain)
    plain.shutdown()
    for on, off in zip(got, expected):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        _same_logprobs(on, off)
