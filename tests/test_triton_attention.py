"""Tests for the Triton paged-attention kernels (steerable.layers.attention_backends.triton_paged).

On a CUDA machine they run on the GPU. Without CUDA they run under Triton's CPU interpreter,
which has to be switched on before Triton is imported:

    TRITON_INTERPRET=1 python -m pytest tests/test_triton_attention.py

Without CUDA and without TRITON_INTERPRET=1 the module is skipped; without Triton installed
it is skipped too.

Every case is checked against an independent float32 reference that gathers K/V through the
block table and applies an explicit causal (+ sliding-window) mask per sequence. Cache slots
that no sequence owns are filled with NaN (block 0 is an all-NaN "poison" block that unused
block-table entries point to), so any out-of-range read shows up as NaN in the output.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("no CUDA GPU: run under the Triton interpreter with "
                "`TRITON_INTERPRET=1 python -m pytest tests/test_triton_attention.py`",
                allow_module_level=True)

from steerable.layers.attention_backends import triton_paged as tp  # noqa: E402
from steerable.layers.attention_backends.triton_paged import (  # noqa: E402
    DecodeWorkspace,
    paged_attention,
    store_kv,
)

pytestmark = pytest.mark.triton

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
SENTINEL = 7.0  # written into `out` beforehand: rows the op must not touch keep it


# --------------------------------------------------------------------------------------
# case construction and the naive reference
# --------------------------------------------------------------------------------------


def make_case(seqs, num_q_heads, num_kv_heads, head_d, block_size, dtype=torch.float32,
              seed=0, pad_tokens=0, spare_cols=2):
    """Build a ragged batch. ``seqs`` is a list of (context_len, query_len).

    Physical blocks are a random permutation of 1..N (block 0 is an all-NaN poison block);
    unused block-table entries point at block 0 and unowned cache slots hold NaN.
    ``pad_tokens`` extra query rows sit after query_start_loc[B] (CUDA-graph style padding).
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in seqs]
    q_lens = [n for _, n in seqs]
    n_blocks = [-(-s // block_size) for s in seq_lens]
    total_blocks = sum(n_blocks) + 1 + 3  # poison block 0 and a few never-used ones
    perm = (torch.randperm(total_blocks - 1, generator=g) + 1).tolist()
    max_blocks = max(n_blocks + [1]) + spare_cols
    block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)

    k_cache = torch.full((total_blocks, block_size, num_kv_heads, head_d), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    i = 0
    for b, s in enumerate(seq_lens):
        block_table[b, :n_blocks[b]] = torch.tensor(perm[i:i + n_blocks[b]], dtype=torch.int32)
        i += n_blocks[b]
        if s:
            pos = torch.arange(s)
            blk = block_table[b, pos // block_size].long()
            k_cache[blk, pos % block_size] = torch.randn(s, num_kv_heads, head_d, generator=g)
            v_cache[blk, pos % block_size] = torch.randn(s, num_kv_heads, head_d, generator=g)

    T = sum(q_lens) + pad_tokens
    q = torch.randn(T, num_q_heads, head_d, generator=g)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    case = dict(
        q=q.to(dtype), k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        max_query_len=max(q_lens + [0]),
        scale=head_d ** -0.5,
    )
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def reference_attention(case, sliding_window=None, softcap=None):
    """Naive float32 attention, one sequence at a time. Rows of sequences that see no key
    (seq_len 0) are zero; rows past query_start_loc[B] are NaN (must not be compared)."""
    q = case["q"].float().cpu()
    k_cache = case["k_cache"].float().cpu()
    v_cache = case["v_cache"].float().cpu()
    qsl = case["query_start_loc"].tolist()
    seq_lens = case["seq_lens"].tolist()
    bt = case["block_table"].cpu().long()
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.full_like(q, float("nan"))
    for b, seq_len in enumerate(seq_lens):
        s, e = qsl[b], qsl[b + 1]
        if e == s:
            continue
        if seq_len == 0:
            out[s:e] = 0.0
            continue
        ctx = seq_len - (e - s)
        pos = torch.arange(seq_len)
        blk = bt[b, pos // block_size]
        k = k_cache[blk, pos % block_size].repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_cache[blk, pos % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k) * case["scale"]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = ctx + torch.arange(e - s)
        allowed = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out


def run_and_check(case, sliding_window=None, workspace=None, atol=None, softcap=None):
    out = torch.full_like(case["q"], SENTINEL)
    paged_attention(case["q"], case["k_cache"], case["v_cache"], out, case["query_start_loc"],
                    case["seq_lens"], case["block_table"], case["max_query_len"], case["scale"],
                    sliding_window=sliding_window, workspace=workspace, softcap=softcap)
    ref = reference_attention(case, sliding_window, softcap)
    got = out.float().cpu()
    n_real = int(case["query_start_loc"][-1])
    assert torch.isfinite(got[:n_real]).all(), "NaN/inf in rows owned by sequences"
    tol = atol if atol is not None else TOL[case["q"].dtype]
    torch.testing.assert_close(got[:n_real], ref[:n_real], atol=tol, rtol=tol)
    # rows beyond query_start_loc[B] are not owned by any sequence: left untouched
    assert (got[n_real:] == SENTINEL).all()
    return got


def _dtype_id(v):
    return str(v).replace("torch.", "") if isinstance(v, torch.dtype) else None


def dtypes():
    # bf16 tl.dot is not emulated correctly by the interpreter (it multiplies raw uint16)
    return [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


# --------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtypes(), ids=_dtype_id)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(dtype, block_size):
    g = torch.Generator().manual_seed(1)
    T, num_kv_heads, head_d, num_blocks = 37, 4, 64, 6
    # key/value as strided views of a fused qkv projection output (non-contiguous rows)
    qkv = torch.randn(T, 8 + 2 * num_kv_heads, head_d, generator=g).to(dtype).to(DEVICE)
    key, value = qkv[:, 8:8 + num_kv_heads], qkv[:, 8 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[torch.tensor([0, 5, 17, 36])] = -1  # padding rows: skipped
    slot_mapping = slots.to(torch.int64).to(DEVICE)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_d), SENTINEL,
                         dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    store_kv(key, value, k_cache, v_cache, slot_mapping)

    expect_k = torch.full_like(k_cache, SENTINEL).view(-1, num_kv_heads, head_d)
    expect_v = expect_k.clone()
    keep = slots >= 0
    expect_k[slots[keep].to(DEVICE)] = key[keep.to(DEVICE)]
    expect_v[slots[keep].to(DEVICE)] = value[keep.to(DEVICE)]
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_d), expect_k)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_d), expect_v)


def test_store_kv_odd_head_size_then_attention():
    """store_kv (D=80, padded to 128 in-kernel) feeding paged_attention end to end."""
    seqs = [(0, 21), (10, 1)]
    case = make_case(seqs, 4, 2, 80, 16)
    g = torch.Generator().manual_seed(3)
    # rewrite every owned slot through store_kv from fresh values
    flat_slots = []
    for b, s in enumerate(case["seq_lens"].tolist()):
        pos = torch.arange(s)
        blk = case["block_table"][b].cpu().long()[pos // 16]
        flat_slots.append(blk * 16 + pos % 16)
    slots = torch.cat(flat_slots)
    key = torch.randn(len(slots), 2, 80, generator=g).to(DEVICE)
    value = torch.randn(len(slots), 2, 80, generator=g).to(DEVICE)
    store_kv(key, value, case["k_cache"], case["v_cache"], slots.to(DEVICE))
    assert torch.equal(case["k_cache"].view(-1, 2, 80)[slots.to(DEVICE)], key)
    run_and_check(case)


# --------------------------------------------------------------------------------------
# paged_attention: prefill / chunked prefill / prefix hits
# --------------------------------------------------------------------------------------

HEAD_LAYOUTS = {  # (Hq, Hkv): GQA ratio
    "mha8": (8, 8), "gqa2": (8, 4), "gqa4": (16, 4), "gqa8": (16, 2),
}


@pytest.mark.parametrize("heads,head_d,block_size", [
    ("mha8", 64, 16), ("gqa2", 128, 32), ("gqa4", 64, 32), ("gqa8", 128, 16),
])
def test_prefill(heads, head_d, block_size):
    seqs = [(0, 1), (0, 7), (0, 16), (0, 33), (0, 100)]
    case = make_case(seqs, *HEAD_LAYOUTS[heads], head_d, block_size, seed=10)
    run_and_check(case)


@pytest.mark.parametrize("sliding_window", [None, 24])
@pytest.mark.parametrize("heads,head_d,block_size", [("gqa4", 64, 16), ("gqa2", 128, 32)])
def test_chunked_prefill_with_context(heads, head_d, block_size, sliding_window):
    seqs = [(40, 25), (16, 16), (5, 3), (100, 37), (31, 1)]
    case = make_case(seqs, *HEAD_LAYOUTS[heads], head_d, block_size, seed=11)
    run_and_check(case, sliding_window)


@pytest.mark.parametrize("sliding_window", [None, 50])
def test_prefix_hit_long_context_short_query(sliding_window):
    seqs = [(250, 3), (128, 5), (64, 2), (287, 13)]
    case = make_case(seqs, 16, 4, 64, 16, seed=12)
    run_and_check(case, sliding_window)


@pytest.mark.parametrize("max_query_len", [None, 1, 2, 64])
def test_short_multi_token_queries(max_query_len):
    """Speculative-decode style 1-3 token queries. The unified path is correct for any
    ``max_query_len`` hint (it only shapes tiles and the grid); None = the true maximum."""
    seqs = [(10, 2), (0, 1), (33, 3), (64, 1), (5, 2), (15, 2)]
    case = make_case(seqs, 8, 2, 64, 16, seed=13)
    if max_query_len is not None:
        case["max_query_len"] = max_query_len
    run_and_check(case, sliding_window=None if max_query_len != 2 else 8)


# --------------------------------------------------------------------------------------
# decode (max_query_len == 1): single-pass and split-KV paths
# --------------------------------------------------------------------------------------

DECODE_LENS = {
    1: [300],
    3: [1, 16, 257],
    17: [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 300],
}


@pytest.mark.parametrize("path", ["single", "split"])
@pytest.mark.parametrize("batch,heads,head_d,block_size,sliding_window,dtype", [
    (1, "gqa8", 128, 16, None, torch.float32),
    (3, "gqa4", 64, 32, None, torch.float32),
    (3, "mha8", 128, 16, 40, torch.float32),
    (17, "gqa8", 64, 16, None, torch.float32),
    (17, "gqa2", 64, 32, 100, torch.float16),
], ids=_dtype_id)
def test_decode(batch, heads, head_d, block_size, sliding_window, dtype, path):
    seqs = [(n - 1, 1) for n in DECODE_LENS[batch]]
    num_q_heads, num_kv_heads = HEAD_LAYOUTS[heads]
    case = make_case(seqs, num_q_heads, num_kv_heads, head_d, block_size, dtype, seed=batch)
    ws = None
    if path == "split":
        assert batch * num_kv_heads <= tp.CONFIG.split_kv_max_programs
        ws = DecodeWorkspace(batch, num_q_heads, head_d, DEVICE, num_segments=4)
    run_and_check(case, sliding_window, workspace=ws)


@pytest.mark.parametrize("num_segments", [1, 3, 16, 64])
def test_split_kv_segments_match_single_path(num_segments):
    seqs = [(n - 1, 1) for n in (1, 33, 300, 64, 129)]
    case = make_case(seqs, 8, 2, 64, 16, seed=21)
    single = run_and_check(case)
    ws = DecodeWorkspace(8, 8, 64, DEVICE, num_segments=num_segments)  # B=5 < max_num_seqs
    split = run_and_check(case, workspace=ws)
    n = int(case["query_start_loc"][-1])
    torch.testing.assert_close(split[:n], single[:n], atol=1e-5, rtol=1e-5)


def test_split_kv_workspace_reuse_and_fallback(monkeypatch):
    ws = DecodeWorkspace(4, 8, 64, DEVICE, num_segments=8)
    # reuse the same workspace for two different batches (stale contents must not leak)
    run_and_check(make_case([(299, 1), (40, 1), (7, 1), (100, 1)], 8, 4, 64, 16, seed=1),
                  workspace=ws)
    run_and_check(make_case([(3, 1), (64, 1)], 8, 4, 64, 16, seed=2), workspace=ws)
    # B > max_num_seqs, or B*Hkv above the threshold: falls back to the single-pass path
    run_and_check(make_case([(5, 1)] * 6, 8, 4, 64, 16, seed=3), workspace=ws)
    monkeypatch.setattr(tp.CONFIG, "split_kv_max_programs", 1)
    run_and_check(make_case([(5, 1), (70, 1)], 8, 4, 64, 16, seed=4), workspace=ws)


# --------------------------------------------------------------------------------------
# mixed batches, GQA ratios, head sizes, padding, tile configurations
# --------------------------------------------------------------------------------------

MIXED = [(0, 1), (47, 1), (0, 20), (15, 1), (33, 17), (0, 0), (255, 1), (64, 9)]


@pytest.mark.parametrize("dtype", dtypes(), ids=_dtype_id)
@pytest.mark.parametrize("sliding_window", [None, 32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_prefill_decode_one_call(dtype, sliding_window, block_size):
    case = make_case(MIXED, 16, 4, 64, block_size, dtype, seed=31, pad_tokens=3)
    run_and_check(case, sliding_window)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (16, 2), (16, 1),
                                                      (12, 4)])
def test_gqa_ratios(num_q_heads, num_kv_heads):
    # (12, 4): ratio 3, not a power of two -> padded GQA group
    case = make_case(MIXED, num_q_heads, num_kv_heads, 64, 16, seed=41)
    run_and_check(case)
    # the same heads through split-KV decode
    dec = make_case([(70, 1), (0, 1), (16, 1)], num_q_heads, num_kv_heads, 64, 16, seed=42)
    run_and_check(dec, workspace=DecodeWorkspace(3, num_q_heads, 64, DEVICE, num_segments=4))


@pytest.mark.parametrize("head_d", [64, 128, 80, 256])  # 256: Gemma 3
def test_head_sizes(head_d):
    case = make_case(MIXED, 8, 2, head_d, 16, seed=51)
    run_and_check(case, sliding_window=20)
    dec = make_case([(130, 1), (5, 1)], 8, 2, head_d, 16, seed=52)
    run_and_check(dec, workspace=DecodeWorkspace(2, 8, head_d, DEVICE, num_segments=4))


def test_padding_sequences_and_rows():
    """Padding sequences (query_len 0, seq_len 0 with a query row, stale seq_len with no query)
    and padding rows past query_start_loc[B] are harmless."""
    seqs = [(0, 0), (20, 1), (0, 5), (37, 0), (0, 1), (0, 0)]
    case = make_case(seqs, 8, 2, 64, 16, seed=61, pad_tokens=4)
    case["seq_lens"][4] = 0  # decode-style padding row: seq_len 0 with query_len 1
    got = run_and_check(case)
    assert (got[6] == 0).all()  # no key visible -> zeros, not NaN
    ws = DecodeWorkspace(8, 8, 64, DEVICE, num_segments=4)
    dec = make_case([(0, 0), (20, 1), (0, 1), (37, 0), (9, 1)], 8, 2, 64, 16, seed=62,
                    pad_tokens=2)
    dec["seq_lens"][2] = 0
    got = run_and_check(dec, workspace=ws)
    assert (got[1] == 0).all()
    # slot -1 rows are skipped by store_kv
    before = case["k_cache"].clone()
    key = torch.randn(3, 2, 64, device=DEVICE)
    store_kv(key, key, case["k_cache"], case["v_cache"],
             torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(torch.nan_to_num(case["k_cache"], 1.0), torch.nan_to_num(before, 1.0))


def test_empty_batch_is_noop():
    case = make_case([(5, 1)], 8, 2, 64, 16)
    out = torch.full((0, 8, 64), SENTINEL, device=DEVICE)
    paged_attention(case["q"][:0], case["k_cache"], case["v_cache"], out,
                    case["query_start_loc"][:1], case["seq_lens"][:0], case["block_table"][:0],
                    0, case["scale"])


@pytest.mark.parametrize("prefill_block_m,tile_n,block_size", [
    (16, 16, 32),   # tile inside one cache block (one block-table lookup per tile)
    (16, 32, 32),   # tile == block
    (128, 64, 16),  # tile spans several blocks (per-position lookup), big query blocks
    (32, 32, 16),
])
def test_tile_configurations(monkeypatch, prefill_block_m, tile_n, block_size):
    for name, value in (("prefill_block_m", prefill_block_m), ("prefill_tile_n", tile_n),
                        ("decode_tile_n", tile_n), ("split_tile_n", tile_n)):
        monkeypatch.setattr(tp.CONFIG, name, value)
    case = make_case(MIXED, 8, 2, 64, block_size, seed=71)
    run_and_check(case)
    run_and_check(case, sliding_window=19)
    dec = make_case([(n - 1, 1) for n in (1, 16, 17, 100)], 8, 2, 64, block_size, seed=72)
    run_and_check(dec)
    run_and_check(dec, workspace=DecodeWorkspace(4, 8, 64, DEVICE, num_segments=3),
                  sliding_window=33)


def test_wide_heads_take_their_own_decode_tile(monkeypatch):
    """Heads wider than 128 (Gemma 2's 256) decode with ``CONFIG_WIDE``: with the narrow tile set to a
    size the kernel cannot build, a 256-wide decode batch still runs and is exact, soft-capped as
    Gemma 2 caps, and a 128-wide one fails."""
    monkeypatch.setattr(tp.CONFIG_WIDE, "split_kv_max_programs", 0)  # the unified kernel's decode tile
    monkeypatch.setattr(tp.CONFIG, "decode_tile_n", 3)
    monkeypatch.setattr(tp.CONFIG_WIDE, "decode_tile_n", 32)
    assert tp.config_for(256) is tp.CONFIG_WIDE and tp.config_for(128) is tp.CONFIG
    wide = make_case([(n - 1, 1) for n in (1, 40, 97)], 4, 2, 256, 16, seed=73)
    run_and_check(wide)
    run_and_check(wide, softcap=50.0)
    with pytest.raises(Exception) as failure:
        run_and_check(make_case([(n - 1, 1) for n in (1, 40)], 4, 2, 128, 16, seed=74))
    chain, error = [], failure.value  # Triton's compiler wraps the cause, its interpreter does not
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("power of 2" in message for message in chain)


WIDE_DECODE = [(n - 1, 1) for n in (1, 17, 64, 97, 130)]


@pytest.mark.parametrize("dtype", dtypes(), ids=_dtype_id)
@pytest.mark.parametrize("softcap,window", [(None, None), (50.0, None), (None, 40), (2.0, 40)])
@pytest.mark.parametrize("tile_n", [16, 32, 64])
def test_wide_decode_tiles(monkeypatch, dtype, softcap, window, tile_n):
    """The wide decode tiles attention_replay / gemma2_decode sweep (16, 32, 64 positions), on the
    unified kernel, against the reference: soft-cap and window on and off (scale 1 and a cap of 2
    bend the scores; 50 is Gemma 2's)."""
    monkeypatch.setattr(tp.CONFIG_WIDE, "split_kv_max_programs", 0)
    monkeypatch.setattr(tp.CONFIG_WIDE, "decode_tile_n", tile_n)
    case = make_case(WIDE_DECODE, 4, 2, 256, 16, dtype, seed=75)
    if softcap == 2.0:
        case["scale"] = 0.25
    run_and_check(case, sliding_window=window, softcap=softcap)


@pytest.mark.parametrize("dtype", dtypes(), ids=_dtype_id)
@pytest.mark.parametrize("softcap,window", [(None, None), (2.0, None), (50.0, 40)])
@pytest.mark.parametrize("target,split_tile", [(20, 32), (64, 16), (1000, 64)])
def test_split_kv_program_target(monkeypatch, dtype, softcap, window, target, split_tile):
    """``split_kv_target_programs``: a decode batch of any size may take split-KV, cut into at least that
    many programs (a power of two of segments, at most the workspace's); exact against the reference
    and the unified kernel, soft-capped and windowed."""
    for name, value in (("split_kv_max_programs", 1024), ("split_kv_target_programs", target),
                        ("split_tile_n", split_tile)):
        monkeypatch.setattr(tp.CONFIG_WIDE, name, value)
    case = make_case(WIDE_DECODE, 4, 2, 256, 16, dtype, seed=76)
    case["scale"] = 0.25
    ws = DecodeWorkspace(8, 4, 256, DEVICE, num_segments=8)
    segments = tp.split_segments(5, 2, 1, ws)
    assert segments == min(8, 1 << (-(-target // 10) - 1).bit_length())  # 5 sequences x 2 KV heads
    split = run_and_check(case, sliding_window=window, workspace=ws, softcap=softcap)
    monkeypatch.setattr(tp.CONFIG_WIDE, "split_kv_max_programs", 0)
    unified = run_and_check(case, sliding_window=window, softcap=softcap)
    n = int(case["query_start_loc"][-1])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(split[:n], unified[:n], atol=tol, rtol=tol)


def test_split_kv_program_target_limits(monkeypatch):
    """A target a batch already meets gives one segment, which is the unified kernel (no reduce);
    a batch past split_kv_max_programs or the workspace's rows is unified too; the narrow config is
    not touched by the wide one's target. Shared-prefix attention shares exactly where split-KV is off."""
    from steerable.layers.attention_backends.shared_prefix import shares

    monkeypatch.setattr(tp.CONFIG_WIDE, "split_kv_max_programs", 512)
    monkeypatch.setattr(tp.CONFIG_WIDE, "split_kv_target_programs", 256)
    wide, narrow = DecodeWorkspace(300, 8, 256, DEVICE), DecodeWorkspace(300, 8, 128, DEVICE)
    assert [tp.split_segments(b, 4, 1, wide) for b in (1, 4, 12, 16, 32, 64, 128, 129)] == [16, 16, 8, 4, 2, 0, 0, 0]
    assert tp.split_segments(16, 4, 2, wide) == 0  # prefill hints never split
    assert tp.split_segments(16, 4, 1, DecodeWorkspace(8, 8, 256, DEVICE)) == 0  # more sequences than rows
    assert [tp.split_segments(b, 4, 1, narrow) for b in (16, 32, 33)] == [16, 16, 0]  # CONFIG: 128 programs
    assert [shares(b, 4, 1, wide) for b in (16, 64)] == [False, True]


def test_config_overrides():
    config = tp.TritonAttentionConfig()
    tp.apply_overrides(config, "decode_tile_n=32, split_kv_target_programs=2048,")
    assert (config.decode_tile_n, config.split_kv_target_programs) == (32, 2048)
    tp.apply_overrides(config, "")
    assert config.decode_tile_n == 32
    with pytest.raises(ValueError, match="unknown attention config field 'tile'"):
        tp.apply_overrides(config, "tile=3")
    with pytest.raises(ValueError, match="takes an integer"):
        tp.apply_overrides(config, "decode_tile_n=big")


# --------------------------------------------------------------------------------------
# GPU only: CUDA-graph capture of the decode paths
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("path", ["single", "split"])
def test_cuda_graph_capture_decode(path):
    """Capture once, then replay with different seq_lens / block tables written in place."""
    batch, hq, hkv, d, bs = 4, 16, 4, 128, 16
    case = make_case([(n - 1, 1) for n in (300, 257, 100, 64)], hq, hkv, d, bs, torch.bfloat16,
                     seed=81, spare_cols=20)
    ws = DecodeWorkspace(batch, hq, d, DEVICE) if path == "split" else None
    out = torch.zeros_like(case["q"])
    args = lambda: (case["q"], case["k_cache"], case["v_cache"], out,  # noqa: E731
                    case["query_start_loc"], case["seq_lens"], case["block_table"], 1,
                    case["scale"], None, ws)
    paged_attention(*args())  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the op raises
    try:
        with torch.cuda.graph(graph):
            paged_attention(*args())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed, lens in ((82, (5, 33, 310, 128)), (83, (1, 1, 2, 64))):
        new = make_case([(n - 1, 1) for n in lens], hq, hkv, d, bs, torch.bfloat16, seed=seed)
        assert new["k_cache"].shape[0] <= case["k_cache"].shape[0]
        case["k_cache"][:new["k_cache"].shape[0]].copy_(new["k_cache"])
        case["v_cache"][:new["v_cache"].shape[0]].copy_(new["v_cache"])
        case["q"].copy_(new["q"])
        case["seq_lens"].copy_(new["seq_lens"])
        case["block_table"].zero_()
        case["block_table"][:, :new["block_table"].shape[1]].copy_(new["block_table"])
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_attention(new)
        torch.testing.assert_close(out.float().cpu(), ref, atol=4e-2, rtol=4e-2)


# --------------------------------------------------------------------------------------
# logit soft-capping (Gemma 2)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["unified", "split_kv"])
@pytest.mark.parametrize("window", [None, 5])
def test_softcap_matches_reference_and_matters(split, window):
    """cap * tanh(s / cap) before the mask, on the prefill/decode kernel and the split-KV decode
    kernel; a cap small against the scores (scale 1 here) changes the output (effect size)."""
    seqs = [(0, 1), (9, 1), (21, 1)] if split else [(0, 7), (13, 1), (6, 12)]
    case = make_case(seqs, 4, 2, 16, 8, seed=11)
    case["scale"] = 1.0  # scores of several units: a cap of 2 bends them
    workspace = DecodeWorkspace(4, 4, 16, DEVICE, num_segments=3) if split else None
    capped = run_and_check(case, sliding_window=window, workspace=workspace, softcap=2.0)
    plain = reference_attention(case, window)
    n_real = int(case["query_start_loc"][-1])
    assert (capped.float().cpu()[:n_real] - plain[:n_real]).abs().max() > 0.1
