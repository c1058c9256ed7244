"""Invariant 3: a request's greedy output does not depend on batch company, chunked prefill,
prefix-cache hits or preemption."""

import random

import pytest
from conftest import PROMPTS

from steerable import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts(llm, n=16, seed=0):
    """16 token-id prompts of varied lengths, several sharing long prefixes (cache hits)."""
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    shared = tok(PROMPTS[5] + " " + PROMPTS[3]).input_ids  # ~40 tokens shared prefix
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            prompts.append(shared + [rng.randrange(10, 300) for _ in range(rng.randrange(1, 9))])
        else:
            prompts.append([rng.randrange(10, 300) for _ in range(rng.randrange(3, 60))])
    return prompts


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(model_dirs):
    """Each prompt run alone, no prefix caching: the ground truth."""
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False)
    prompts = _prompts(llm)
    return prompts, [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_batched_equals_alone(model_dirs, reference):
    prompts, alone = reference
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone


def test_chunked_prefill(model_dirs, reference):
    prompts, alone = reference
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
    assert llm.engine.num_steps > 40  # the 16 prompts (~500 tokens) really were split into chunks


def test_prefix_cache_hits(model_dirs, reference):
    prompts, alone = reference
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # warm the cache with the shared prefix
    assert _tokens(first) == alone[:1]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 8 * 32, stats
    assert _tokens(outs) == alone
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # every full block now cached
    assert _tokens(again) == alone
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.stats()["num_blocks"]


def test_preemption(model_dirs, reference):
    prompts, alone = reference
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=256, block_size=16, max_num_seqs=16)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert _tokens(outs) == alone
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.stats()["num_blocks"]


def test_preemption_chunked_and_cached_together(model_dirs, reference):
    prompts, alone = reference
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=256, block_size=16, max_num_batched_tokens=24)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert _tokens(outs) == alone


def test_preemption_by_a_step_that_runs_nothing(model_dirs):
    """Prompts longer than a step, in a cache that holds one and a half of them: a request is
    preempted mid-prompt by a schedule that then runs nothing, and must resume on its new blocks
    (its worker row rewritten), not on the ones it gave back."""
    long = [[(7 * i + 13 * j) % 290 + 10 for j in range(100 + 9 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    alone = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    expected = [alone.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in long]
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=160, max_num_batched_tokens=64)
    outs = [o.outputs[0] for o in llm.generate(long, greedy, use_tqdm=False)]
    assert llm.engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert [o.cumulative_logprob for o in outs] == pytest.approx([e.cumulative_logprob for e in expected], abs=1e-5)
