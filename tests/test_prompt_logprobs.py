"""``SamplingParams.prompt_logprobs`` (issue 28): per prompt token its logprob, rank and the k most
likely tokens, equal to HF's log-softmax of the same positions in float32, through chunked prefill,
a prefix-cache hit and ``n`` > 1; and the vLLM fields of ``SamplingParams`` (logit_bias,
allowed_token_ids, truncate_prompt_tokens, include_stop_str_in_output, refused ones by name)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model

from steerable import LLM, SamplingParams
from steerable.errors import InvalidRequestError

PROMPT_IDS = [5, 17, 42, 99, 3, 250, 61, 7, 18, 33, 120, 8, 64, 200, 11, 90, 45, 2, 77, 150]


@pytest.fixture(scope="module")
def chunked(model_dirs):
    """Prefill in chunks of 8 tokens, prefix caching on: both paths prompt logprobs must survive."""
    return LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=8,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(model_dirs):
    model = hf_model(model_dirs["qwen3"])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(prompt_logprobs, ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT_IDS)
    for pos in range(1, len(PROMPT_IDS)):
        row, token, entries = ref[pos - 1], PROMPT_IDS[pos], prompt_logprobs[pos]
        assert abs(entries[token].logprob - row[token].item()) <= 1e-4
        assert entries[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k)
        for rank, (value, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entries[tid].logprob - value) <= 1e-4 and entries[tid].rank == rank
        assert set(entries) <= {token, *top.indices.tolist()}


def test_prompt_logprobs_equal_hf_through_chunks_and_cache(chunked, hf_logprobs):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    first = chunked.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    check_against_hf(first.prompt_logprobs, hf_logprobs, 3)
    # The prompt's blocks are cached now; a request reporting prompt logprobs recomputes them.
    again = chunked.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)[0]
    check_against_hf(again.prompt_logprobs, hf_logprobs, 3)
    hits = chunked.llm_engine.stats()["prefix_cache_hit_tokens"]
    plain = chunked.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=2, temperature=0),
                             use_tqdm=False)[0]
    assert chunked.llm_engine.stats()["prefix_cache_hit_tokens"] > hits  # the cache was there to read
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == first.outputs[0].token_ids
    # Effect size: the values are those of each token's own position, not of its neighbour's.
    n = len(PROMPT_IDS)
    mine = torch.tensor([first.prompt_logprobs[p][PROMPT_IDS[p]].logprob for p in range(1, n)])
    off_by_one = hf_logprobs[torch.arange(1, n), torch.tensor(PROMPT_IDS[1:])]
    assert (mine - off_by_one).abs().max() > 0.1


def test_prompt_logprobs_with_n_and_zero_k(chunked, hf_logprobs):
    out = chunked.generate({"prompt_token_ids": PROMPT_IDS},
                           SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=3, prompt_logprobs=0),
                           use_tqdm=False)[0]
    check_against_hf(out.prompt_logprobs, hf_logprobs, 0)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    one = chunked.generate({"prompt_token_ids": PROMPT_IDS[:1]}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                           use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    assert chunked.llm_engine.stats()["num_free_blocks"] == chunked.llm_engine.stats()["num_blocks"]
