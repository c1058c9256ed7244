"""Shared-prefix (cascade) decode attention against the unshared kernels.

Runs on a GPU, or on a CPU under the Triton interpreter (``TRITON_INTERPRET=1 -m triton``). Rows
of a group hold the same physical blocks at the start of their tables, as the prefix cache hands
them out; the result must equal ``paged_attention``'s decode paths (float32: <= 1e-5) whichever
rows are in the group, and must differ when the prefix is mis-read (effect-size check).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run under the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

from steerable.layers.attention_backends.shared_prefix import shared_prefix_attention  # noqa: E402
from steerable.layers.attention_backends.triton_paged import DecodeWorkspace, paged_attention  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def shared_case(shared_blocks: int, rows: list[tuple[bool, int]], heads=(4, 2), head_d=32, block_size=16,
                dtype=torch.float32, pad_rows=0, seed=0):
    """Decode rows ``(member, own_tokens)``: members' tables start with the same ``shared_blocks``
    physical blocks, then own blocks holding ``own_tokens`` more keys (the last one the current
    token). Non-members have their own copy-free blocks only. ``pad_rows``: CUDA-graph padding
    sequences (one query row, length 0, all-zero table row)."""
    g = torch.Generator().manual_seed(seed)
    num_q, num_kv = heads
    own_blocks = [-(-(n + (0 if m else shared_blocks * block_size)) // block_size) for m, n in rows]
    total = 1 + shared_blocks + sum(own_blocks)
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    shared_ids, rest = perm[:shared_blocks], perm[shared_blocks:]
    width = shared_blocks + max(own_blocks) + 1
    B = len(rows) + pad_rows
    table = torch.zeros(B, width, dtype=torch.int32)
    seq_lens, prefix = [], []
    for b, ((member, n), k) in enumerate(zip(rows, own_blocks)):
        ids, rest = rest[:k], rest[k:]
        lead = shared_ids if member else []
        table[b, :len(lead) + k] = torch.tensor(lead + ids, dtype=torch.int32)
        seq_lens.append(n + (shared_blocks * block_size if member else 0))
        prefix.append(shared_blocks * block_size if member else 0)
    k_cache = torch.randn(total, block_size, num_kv, head_d, generator=g)
    v_cache = torch.randn(total, block_size, num_kv, head_d, generator=g)
    k_cache[0] = v_cache[0] = float("nan")  # block 0: poison, read by no real row
    case = dict(q=torch.randn(B, num_q, head_d, generator=g).to(dtype), k_cache=k_cache.to(dtype),
                v_cache=v_cache.to(dtype), query_start_loc=torch.arange(B + 1, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens + [0] * pad_rows, dtype=torch.int32), block_table=table,
                prefix_lens=torch.tensor(prefix + [0] * pad_rows, dtype=torch.int32), scale=head_d ** -0.5)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def run_shared(case, num_segments=6, softcap=None):
    ws = DecodeWorkspace(case["q"].shape[0], case["q"].shape[1], case["q"].shape[2], DEVICE, num_segments)
    out = torch.full_like(case["q"], 7.0)
    shared_prefix_attention(case["q"], case["k_cache"], case["v_cache"], out, case["query_start_loc"],
                            case["seq_lens"], case["block_table"], case["prefix_lens"], case["scale"], ws,
                            softcap=softcap)
    return out


def run_unshared(case, split: bool, softcap=None):
    ws = DecodeWorkspace(case["q"].shape[0], case["q"].shape[1], case["q"].shape[2], DEVICE) if split else None
    out = torch.full_like(case["q"], 7.0)
    paged_attention(case["q"], case["k_cache"], case["v_cache"], out, case["query_start_loc"], case["seq_lens"],
                    case["block_table"], 1, case["scale"], workspace=ws, softcap=softcap)
    return out


@pytest.mark.parametrize("shared_blocks,rows,heads,head_d,block_size", [
    (4, [(True, 1), (True, 5), (True, 17), (True, 40)], (4, 2), 32, 16),  # ragged own parts
    (3, [(True, 3), (False, 30), (True, 16), (False, 1), (True, 33)], (8, 2), 64, 16),  # mixed members
    (2, [(True, 1)] * 3 + [(True, 70)] * 2, (4, 4), 32, 32),  # MHA, big blocks
    (5, [(True, 2), (True, 9)], (16, 2), 128, 16),  # GQA 8, head size 128
])
def test_matches_unshared_kernels(shared_blocks, rows, heads, head_d, block_size):
    case = shared_case(shared_blocks, rows, heads, head_d, block_size)
    got = run_shared(case)
    for split in (False, True):
        torch.testing.assert_close(got, run_unshared(case, split), atol=1e-5, rtol=1e-5)
    # Effect size: the shared blocks are read (changing their keys changes every member's output).
    k_cache = case["k_cache"].clone()
    k_cache[case["block_table"][0, :shared_blocks].long()] *= 3
    assert (run_shared(dict(case, k_cache=k_cache)) - got)[0].abs().max() > 1e-2


def test_membership_changes_are_data_only():
    """Rows join and leave the group between calls on the same tensors (a graph replays one launch):
    every grouping gives the unshared result, the non-members reading the prefix blocks themselves."""
    case = shared_case(4, [(True, 3)] * 6)
    expected = run_unshared(case, split=True)
    for members in ([0, 1, 2, 3, 4, 5], [1, 4], [5], []):
        prefix = torch.zeros_like(case["prefix_lens"])
        prefix[members] = 4 * 16
        got = run_shared(dict(case, prefix_lens=prefix))
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_padding_rows_and_tiny_workspace():
    """CUDA-graph padding sequences (length 0) get 0; the fewest segments the op accepts work."""
    case = shared_case(2, [(True, 4), (True, 1), (False, 9)], pad_rows=3)
    got = run_shared(case, num_segments=5)
    torch.testing.assert_close(got, run_unshared(case, split=True), atol=1e-5, rtol=1e-5)
    assert (got[3:] == 0).all()


def test_softcap():
    """Gemma 2's capped scores: the same cap on both passes."""
    case = shared_case(3, [(True, 5), (True, 20), (False, 7)])
    case["q"] *= 4  # scores well past the cap, so it matters
    got = run_shared(case, softcap=2.0)
    torch.testing.assert_close(got, run_unshared(case, split=True, softcap=2.0), atol=1e-5, rtol=1e-5)
    assert (got - run_shared(case)).abs().max() > 1e-2


def test_float16():
    case = shared_case(3, [(True, 5), (True, 20), (False, 7)], dtype=torch.float16)
    torch.testing.assert_close(run_shared(case), run_unshared(case, split=True), atol=2e-3, rtol=2e-3)


def test_rejects_small_workspace():
    case = shared_case(2, [(True, 4), (True, 1)])
    with pytest.raises(ValueError, match="DecodeWorkspace"):
        run_shared(case, num_segments=4)


def _with_prefill_chunks(case, chunks: dict[int, int]):
    """``case`` with the rows in ``chunks`` turned into prefill chunks of that many query tokens (the
    last ones of the row's keys); their prefix length is 0, as the step builder gives them."""
    g = torch.Generator().manual_seed(1)
    B, heads, head_d = case["q"].shape
    lens = [chunks.get(b, 1) for b in range(B)]
    q = torch.randn(sum(lens), heads, head_d, generator=g).to(case["q"].dtype)
    prefix = case["prefix_lens"].clone()
    prefix[list(chunks)] = 0
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(case, q=q.to(DEVICE), query_start_loc=starts.to(DEVICE), prefix_lens=prefix), max(lens)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_mixed_step_equals_the_unified_kernel(dtype, tol):
    """A step mixing prefill chunks (a member's blocks among them, one of a single token) with decode
    rows in and out of the group: the unified kernel attends the chunks (``skip_single``), the
    shared-prefix op every single-token row, and together they equal the unified kernel alone."""
    base = shared_case(3, [(True, 5), (False, 20), (True, 30), (True, 2), (False, 7), (True, 9), (True, 4)],
                       dtype=dtype, pad_rows=2)
    case, longest = _with_prefill_chunks(base, {1: 12, 2: 17, 6: 1})
    ws = DecodeWorkspace(base["q"].shape[0], case["q"].shape[1], case["q"].shape[2], DEVICE, 6)
    args = (case["k_cache"], case["v_cache"])
    got = torch.full_like(case["q"], 7.0)
    paged_attention(case["q"], *args, got, case["query_start_loc"], case["seq_lens"], case["block_table"], longest,
                    case["scale"], workspace=ws, skip_single=True)
    shared_prefix_attention(case["q"], *args, got, case["query_start_loc"], case["seq_lens"], case["block_table"],
                            case["prefix_lens"], case["scale"], ws)
    expected = torch.full_like(case["q"], 7.0)
    paged_attention(case["q"], *args, expected, case["query_start_loc"], case["seq_lens"], case["block_table"],
                    longest, case["scale"])
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # Each op alone leaves the other's rows untouched: the chunks' rows stay 7 without the unified kernel.
    alone = torch.full_like(case["q"], 7.0)
    shared_prefix_attention(case["q"], *args, alone, case["query_start_loc"], case["seq_lens"], case["block_table"],
                            case["prefix_lens"], case["scale"], ws)
    starts = case["query_start_loc"].tolist()
    chunk_rows = [t for b in (1, 2) for t in range(starts[b], starts[b + 1])]
    assert (alone[chunk_rows] == 7.0).all() and not (alone[starts[0]] == 7.0).all()
