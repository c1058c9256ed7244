"""Shared-prefix attention through the engine, on a CPU under Triton's interpreter (the GPU path's
kernels): requests that hit the prefix cache share its blocks, decode steps read them once, and the
outputs equal an engine with the feature off (and HF greedy). Run with
``TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1 -m triton``."""

import os

import numpy as np
import pytest

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1", allow_module_level=True)

from conftest import hf_greedy, hf_model  # noqa: E402

from steerable import LLM, SamplingParams, SteeringSpec  # noqa: E402

pytestmark = pytest.mark.triton
PREFIX = list(range(5, 45))  # 40 tokens: two whole blocks of 16 shared, the rest mid-block and private


def _engine(path: str, shared: bool) -> LLM:
    return LLM(path, device="cpu", dtype="float32", kv_cache_tokens=2048, attention_backend="triton", max_num_seqs=3,
               enable_shared_prefix_attention=shared, shared_prefix_min_tokens=16, shared_prefix_min_requests=2)


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
        for a, b in zip(on.outputs[0].logprobs, off.outputs[0].logprobs):
            for token, entry in b.items():
                assert abs(a[token].logprob - entry.logprob) <= 1e-5
    hf = hf_model(path)
    first = outs[True][1]
    assert first.outputs[0].token_ids == hf_greedy(hf, list(first.prompt_token_ids), 4)
