"""Shared-prefix (cascade) decode attention against the unshared kernels.

Runs on a GPU, or on a CPU under the Triton interpreter (``TRITON_INTERPRET=1 -m triton``). Rows
of a group hold the same physical blocks at the start of their tables, as the prefix cache hands
them out. Where the unshared kernel is the unified one (here forced for every batch size by
``split_kv_max_programs = 0``) the result must equal ``paged_attention``'s bit for bit on a GPU
whichever rows are in the group (under the interpreter to the dtype's rounding: numpy's matmul rounds a row
differently by the number of rows), and the prefix must
be read through the shared pass (effect-size and poison checks); where it is split-KV the op is
``paged_attention``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run under the Triton interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

from steerable.layers.attention_backends import triton_paged  # noqa: E402
from steerable.layers.attention_backends.shared_prefix import shared_prefix_attention, shares  # noqa: E402
from steerable.layers.attention_backends.triton_paged import DecodeWorkspace, paged_attention  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def assert_same(got, expected):
    """Bit for bit on a GPU; to rounding under the interpreter (see above)."""
    if DEVICE == "cuda":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected)  # the dtype's default tolerance: 1.3e-6 for float32


@pytest.fixture(autouse=True)
def unified_decode(monkeypatch):
    """Every decode batch takes the unified kernel, as batches past the split-KV limit do."""
    monkeypatch.setattr(triton_paged.CONFIG, "split_kv_max_programs", 0)


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


def run_shared(case, max_query_len=1, softcap=None):
    ws = DecodeWorkspace(case["seq_lens"].shape[0], case["q"].shape[1], case["q"].shape[2], DEVICE)
    out = torch.full_like(case["q"], 7.0)
    shared_prefix_attention(case["q"], case["k_cache"], case["v_cache"], out, case["query_start_loc"],
                            case["seq_lens"], case["block_table"], max_query_len, case["prefix_lens"], case["scale"],
                            ws, softcap=softcap)
    return out


def run_unshared(case, max_query_len=1, softcap=None):
    ws = DecodeWorkspace(case["seq_lens"].shape[0], case["q"].shape[1], case["q"].shape[2], DEVICE)
    out = torch.full_like(case["q"], 7.0)
    paged_attention(case["q"], case["k_cache"], case["v_cache"], out, case["query_start_loc"], case["seq_lens"],
                    case["block_table"], max_query_len, case["scale"], workspace=ws, softcap=softcap)
    return out


def poison_members_prefix(case, shared_blocks):
    """Members other than the first with their prefix blocks replaced by the all-NaN block 0: only a
    shared pass, which reads the prefix through the first member's table, still gets their output."""
    table = case["block_table"].clone()
    members = (case["prefix_lens"] > 0).nonzero().flatten().tolist()
    table[members[1:], :shared_blocks] = 0
    return dict(case, block_table=table)


@pytest.mark.parametrize("shared_blocks,rows,heads,head_d,block_size", [
    (4, [(True, 1), (True, 5), (True, 17), (True, 40)], (4, 2), 32, 16),  # ragged own parts
    (3, [(True, 3), (False, 30), (True, 16), (False, 1), (True, 33)], (8, 2), 64, 16),  # mixed members
    (2, [(True, 1)] * 3 + [(True, 70)] * 2, (4, 4), 32, 32),  # MHA, big blocks
    (5, [(True, 2), (True, 9)], (16, 2), 128, 16),  # GQA 8, head size 128
    (10, [(True, 4), (False, 50), (True, 1), (True, 130)], (4, 2), 32, 16),  # a prefix of 160: 1 tile + 32 keys
])
def test_equals_unshared_kernel_bit_for_bit(shared_blocks, rows, heads, head_d, block_size):
    case = shared_case(shared_blocks, rows, heads, head_d, block_size)
    got = run_shared(case)
    assert_same(got, run_unshared(case))
    # Effect size: the shared blocks are read (changing their keys changes every member's output).
    k_cache = case["k_cache"].clone()
    k_cache[case["block_table"][0, :shared_blocks].long()] *= 3
    assert (run_shared(dict(case, k_cache=k_cache)) - got)[0].abs().max() > 1e-2
    # The members' prefix tiles come from the shared pass: their own tables' prefix is not read.
    tile = triton_paged.unified_launch(head_d, 1, 1)[2]
    if shared_blocks * block_size >= tile:
        poisoned = run_shared(poison_members_prefix(case, shared_blocks * block_size // tile * tile // block_size))
        assert_same(poisoned, got)


def test_membership_changes_are_data_only():
    """Rows join and leave the group between calls on the same tensors (a graph replays one launch):
    every grouping gives the unshared result, the non-members reading the prefix blocks themselves."""
    case = shared_case(8, [(True, 3)] * 6)
    expected = run_unshared(case)
    for members in ([0, 1, 2, 3, 4, 5], [1, 4], [5], []):
        prefix = torch.zeros_like(case["prefix_lens"])
        prefix[members] = 8 * 16
        assert_same(run_shared(dict(case, prefix_lens=prefix)), expected)


def test_padding_rows():
    """CUDA-graph padding sequences (length 0) get 0."""
    case = shared_case(8, [(True, 4), (True, 1), (False, 9)], pad_rows=3)
    got = run_shared(case)
    assert_same(got, run_unshared(case))
    assert (got[3:] == 0).all()


def test_softcap():
    """Gemma 2's capped scores: the same cap on both launches."""
    case = shared_case(8, [(True, 5), (True, 20), (False, 7)])
    case["q"] *= 4  # scores well past the cap, so it matters
    got = run_shared(case, softcap=2.0)
    assert_same(got, run_unshared(case, softcap=2.0))
    assert (got - run_shared(case)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit(dtype):
    case = shared_case(8, [(True, 5), (True, 20), (False, 7), (True, 1)], dtype=dtype)
    assert_same(run_shared(case), run_unshared(case))


def test_split_kv_batches_are_not_shared(monkeypatch):
    """Below the split-KV limit the unshared kernel cuts each row's keys its own way: the op is the
    split-KV kernel there, prefix table rows included (nothing is read through the first member's)."""
    monkeypatch.setattr(triton_paged.CONFIG, "split_kv_max_programs", 128)
    case = shared_case(8, [(True, 5), (True, 20), (False, 7)])
    assert not shares(3, 2, 1, DecodeWorkspace(3, 4, 32, DEVICE)) and shares(3, 2, 2, DecodeWorkspace(3, 4, 32, DEVICE))
    assert_same(run_shared(case), run_unshared(case))
    assert run_shared(poison_members_prefix(case, 8))[1].isnan().all()


def test_rejects_short_prefix_lens():
    case = shared_case(8, [(True, 4), (True, 1)])
    with pytest.raises(ValueError, match="prefix_lens"):
        run_shared(dict(case, prefix_lens=case["prefix_lens"][:1]))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_equals_the_unified_kernel(dtype):
    """A step mixing prefill chunks (a member's blocks among them, one of a single token) with decode
    rows in and out of the group: one unified launch attends the chunks and resumes the members,
    with the prefill tile, and equals the unified kernel alone."""
    base = shared_case(8, [(True, 5), (False, 20), (True, 30), (True, 2), (False, 7), (True, 9), (True, 4)],
                       dtype=dtype, pad_rows=2)
    case, longest = _with_prefill_chunks(base, {1: 12, 2: 17, 6: 1})
    got = run_shared(case, max_query_len=longest)
    assert_same(got, run_unshared(case, max_query_len=longest))
    assert_same(run_shared(poison_members_prefix(case, 8), max_query_len=longest), got)
