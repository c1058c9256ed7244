"""Start-up warm-up (``ModelRunner.warmup``, run inside ``LLM(...)`` on a GPU unless
``enforce_eager``): its synthetic steps fit the engine's limits and leave nothing a request sees."""

import torch
from conftest import PROMPTS

from steerable import LLM, SamplingParams
from steerable.worker.warmup import PREFILL_QUERY_LENS, compile_steps, graph_steps


def _check_synthetic(steps) -> None:
    for s in steps:  # every sequence stays in block 0, and samples its last token
        assert (s.slot_mapping < 16).all() and (s.slot_mapping == s.positions % 16).all()
        assert s.sampling.rows.tolist() == (s.query_start[1:] - 1).tolist()


def test_compile_steps_respect_limits():
    steps = list(compile_steps(max_tokens=64, max_num_seqs=8, max_model_len=48, block_size=16))
    assert steps and all(s.num_tokens <= 64 and s.num_requests <= 8 and s.max_query_len <= 48 for s in steps)
    assert {s.max_query_len for s in steps} == {q for q in PREFILL_QUERY_LENS if q <= 48}
    _check_synthetic(steps)


def test_graph_steps_cover_both_ladders():
    """Each mixed size exactly (sequences of up to 128 tokens, within the limits), then each decode
    size sampling inside and outside its graph; with a shared group, the sharing variants too."""
    steps = list(graph_steps([1, 2, 8], [64, 80, 96, 2048], max_num_seqs=8, max_model_len=48, block_size=16,
                             shared_group=None))
    mixed = [s for s in steps if s.max_query_len > 1]
    assert [s.num_tokens for s in mixed] == [64, 80, 96]  # 2048 would need 16 sequences of 128 tokens
    assert all(s.num_requests <= 8 and s.max_query_len <= 48 for s in mixed)
    decode = [s for s in steps if s.max_query_len == 1]
    assert [s.num_requests for s in decode] == [8, 8, 2, 2, 1, 1]
    assert [bool(s.sampling.filtered) for s in decode] == [False, True] * 3
    assert all(s.shared_prefix is None for s in steps)
    _check_synthetic(steps)
    shared = list(graph_steps([1, 2, 8], [64], max_num_seqs=8, max_model_len=64, block_size=16, shared_group=1))
    sharing = [s for s in shared if s.shared_prefix is not None]
    assert [(s.num_tokens, s.max_query_len) for s in sharing] == [(64, 64), (8, 1), (8, 1), (2, 1), (2, 1)]
    assert [bool(s.sampling.filtered) for s in sharing[1:]] == [False, True] * 2
    assert all(s.shared_prefix.group == 1 and not s.shared_prefix.lengths.any() for s in sharing)


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
