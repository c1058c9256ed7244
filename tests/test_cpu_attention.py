"""The CPU attention (``torch_ref``) against dense attention computed sequence by sequence: decode
rows batched (one batch, or two when lengths differ widely), prefill chunks beside them, grouped
query heads, soft-cap and sliding windows, blocks scattered over the cache; through PyTorch ops (a
K cache laid out plainly) and through the compiled CPU kernel (K position-minor, as the engine lays
it out for the kernel)."""

from __future__ import annotations

import math

import pytest
import torch

from steerable.layers import cpu_kernels
from steerable.layers.attention_backends import torch_ref

BLOCK, HKV, GROUP, D = 4, 2, 3, 8


def dense(q, keys, values, q_pos, scale, window, softcap):
    """softmax(q k^T) v of one sequence: keys/values [L, Hkv, D] at positions 0..L-1."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(keys.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v).transpose(0, 1)


def case(query_lens, seq_lens, seed=0, block=BLOCK, hkv=HKV, group=GROUP, d=D):
    """A cache with each sequence's K/V in randomly placed blocks, and the step's queries."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = max(-(-n // block) for n in seq_lens)
    num_blocks = len(seq_lens) * blocks_per_seq + 3
    k_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, block, hkv, d, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:len(seq_lens) * blocks_per_seq].view(len(seq_lens), -1)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(starts[-1]), hkv * group, d, generator=g)
    return q, k_cache, v_cache, table.to(torch.int32), starts, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("query_lens, seq_lens", [
    ([1] * 10, [3, 5, 4, 40, 2, 38, 37, 1, 6, 39]),  # two decode batches (short and long rows)
    ([1, 1, 1], [7, 9, 8]),  # one batch, every row of the step
    ([1, 5, 1, 1, 3], [12, 5, 30, 2, 20]),  # prefill chunks (one with context) between decode rows
])
@pytest.mark.parametrize("window, softcap", [(None, None), (None, 20.0), (6, None)])
@pytest.mark.parametrize("kernel", [False, True])
def test_equals_dense_attention(query_lens, seq_lens, window, softcap, kernel):
    check_against_dense(query_lens, seq_lens, window, softcap, kernel)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])  # 1-4: the query heads of a KV head together; 5: one at a time
def test_kernel_shapes_equal_dense_attention(d, group):
    """The kernel's vector code: blocks of 16, heads of 64 or 128, query heads taken a KV head at a time."""
    for window, softcap in [(None, None), (None, 20.0), (21, None)]:
        check_against_dense([1, 37, 1, 1, 9], [70, 37, 3, 16, 50], window, softcap, True, block=16, hkv=2,
                            group=group, d=d)


def check_against_dense(query_lens, seq_lens, window, softcap, kernel, **shape):
    q, k_cache, v_cache, table, starts, lens = case(query_lens, seq_lens, **shape)
    block, d = k_cache.shape[1], k_cache.shape[3]
    if kernel:
        if cpu_kernels.kernels() is None:
            pytest.skip("no CPU kernels here (no compiler)")
        k_cache = k_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # position-minor memory
    out = torch.full_like(q, float("nan"))
    scale = 1 / math.sqrt(d)
    plans = torch_ref.StepPlans()
    for _ in range(2):  # the second call reads the plan the first one built
        torch_ref.paged_attention(q, k_cache, v_cache, out, starts, lens, table, max(query_lens), scale,
                                  sliding_window=window, workspace=plans, softcap=softcap)
        for b, (n, seq_len) in enumerate(zip(query_lens, seq_lens)):
            slots = [int(table[b, p // block]) * block + p % block for p in range(seq_len)]
            keys = k_cache.flatten(0, 1)[slots]
            values = v_cache.flatten(0, 1)[slots]
            rows = slice(int(starts[b]), int(starts[b + 1]))
            expected = dense(q[rows], keys, values, torch.arange(seq_len - n, seq_len), scale, window, softcap)
            torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
    assert len(plans.plans) == 1


def test_rows_of_very_different_lengths_split_in_two():
    count = torch.tensor(sorted([3, 5, 4, 40, 2, 38, 37, 1, 6, 39])).numpy()
    cut = torch_ref._split(count)
    assert cut == 6  # the six short rows pad to 6 positions, not 40
    assert torch_ref._split(torch.tensor([30, 31, 32, 33, 34, 35, 36, 37]).numpy()) == 0  # alike: one batch
    *_, table, starts, lens = case([1] * 10, [3, 5, 4, 40, 2, 38, 37, 1, 6, 39])
    plan = torch_ref.decode_plan(starts, lens, table, BLOCK, None)
    assert [b.index.shape for b in plan.batches] == [(6, 2), (4, 10)]  # whole blocks: 6 and 40 positions
    assert [b.mask.shape[-1] for b in plan.batches] == [2 * BLOCK, 10 * BLOCK]
