"""Start-up warm-up (``ModelRunner.warmup``, run inside ``LLM(...)`` on a GPU unless
``enforce_eager``): its synthetic steps fit the engine's limits and leave nothing a request sees."""

import torch
from conftest import PROMPTS

from steerable import LLM, SamplingParams
from steerable.worker.warmup import PREFILL_QUERY_LENS, warmup_steps


def test_steps_respect_limits_and_cover_decode_sizes():
    steps = list(warmup_steps(max_tokens=64, max_num_seqs=8, max_model_len=48, block_size=16, decode_sizes=[1, 2, 8]))
    prefill = [s for s in steps if s.max_query_len > 1]
    assert prefill and all(s.num_tokens <= 64 and s.num_requests <= 8 and s.max_query_len <= 48 for s in prefill)
    assert {s.max_query_len for s in prefill} == {q for q in PREFILL_QUERY_LENS if q <= 48}
    assert [s.num_requests for s in steps if s.max_query_len == 1] == [8, 8, 2, 2, 1, 1]
    assert [bool(s.sampling.filtered) for s in steps if s.max_query_len == 1] == [False, True] * 3
    for s in steps:  # every sequence stays in block 0, and samples its last token
        assert (s.slot_mapping < 16).all() and (s.slot_mapping == s.positions % 16).all()
        assert s.sampling.rows.tolist() == (s.query_start[1:] - 1).tolist()


def test_warmup_leaves_no_trace(model_dirs):
    """An engine warmed up at start (the CPU skips it; here it is forced) generates what a cold one does."""
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    cold = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024, max_num_seqs=16)
    warm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024, max_num_seqs=16)
    warm.llm_engine.worker.warmup()
    stats = warm.llm_engine.stats()
    assert stats["num_steps"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    for _ in range(2):  # the second round reads the prefix cache the first one filled
        expected = cold.generate(PROMPTS[:4], params, use_tqdm=False)
        got = warm.generate(PROMPTS[:4], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert torch.isfinite(warm.llm_engine.worker.kv_cache).all()
