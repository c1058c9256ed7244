"""Triton paged-attention kernels: KV-cache writes and unified prefill/decode attention.

Public API
----------
``store_kv(key, value, k_cache, v_cache, slot_mapping)``
    Scatter new K/V rows into the paged cache (``slot = block_id * block_size + offset``,
    ``-1`` skips the row).
``paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
max_query_len, scale, sliding_window=None, workspace=None, k_scale=1.0, v_scale=1.0,
softcap=None)``
    Causal (optionally sliding-window) attention of a flattened ragged batch against the
    paged cache; with ``softcap`` (Gemma 2) scores are ``softcap * tanh(score / softcap)``
    before the mask and softmax (a constexpr branch: uncapped models compile without it).
    Prefill chunks with prefix context and single-token decodes can be mixed in
    one call. A float8 (e4m3) cache holds K / k_scale and V / v_scale: tiles are converted as
    they are loaded (to float16 for a 16-bit query, else to the query's dtype), k_scale is
    folded into the softmax scale and v_scale into the output. V may be head-major (contiguous
    along D) or position-major (contiguous along a block's positions, masked per block: its
    slots must then all hold finite values).
``DecodeWorkspace``
    Preallocated fp32 buffers for the split-KV decode path (keeps the op CUDA-graph safe).
``CONFIG``, ``CONFIG_WIDE``
    Module-level :class:`TritonAttentionConfig` with the tile sizes / warps / stages for heads up to
    128 wide and wider ones, so the kernels can be tuned without touching call sites.

Kernel design
-------------
*Unified kernel* (any batch): a program owns ``BLOCK_Q`` consecutive query tokens of ONE
sequence and ALL query heads that share one KV head (GQA packing), i.e. an
``[BLOCK_M = BLOCK_Q * GQA_PAD, D]`` tile of Q, so ``tl.dot`` runs on tensor cores even for
decode. Grid = ``(T // BLOCK_Q + B) * Hkv`` programs, the KV head varying fastest: query-block
``j`` of sequence ``b`` gets block id ``query_start_loc[b] // BLOCK_Q + b + j`` (a strictly
increasing start per sequence, so a binary search over ``query_start_loc`` inside the kernel
recovers ``b``); surplus programs exit at once. (With ``BLOCK_Q == 1`` no partial blocks exist
and there are ``T * Hkv`` programs.) The
program streams KV tiles of ``TILE_N`` positions through the block table with an online
softmax (exp2 domain, fp32 accumulators), visiting only tiles up to its last query's causal
limit (and from its first query's window start when a sliding window is set).

*Split-KV decode* (``max_query_len == 1``, workspace given, ``B * Hkv`` small): grid
``(B, Hkv, NUM_SEGMENTS)``; each program handles one GQA group of one decode token and a
contiguous share of that sequence's KV tiles (the share is computed in-kernel from
``seq_lens``, so the grid is static), writing unnormalised partial output plus running
max / sum to the workspace. A reduce kernel (grid ``(B, Hq)``) merges the segments.

Everything that shapes a launch (grid, path, constexprs) depends only on host-static values:
tensor shapes, ``max_query_len``, ``sliding_window`` and the config; no device data is read
on the host, so both paths are CUDA-graph capturable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from steerable.layers import fused

__all__ = [
    "CONFIG",
    "CONFIG_WIDE",
    "DecodeWorkspace",
    "TritonAttentionConfig",
    "apply_overrides",
    "config_for",
    "paged_attention",
    "score_scale",
    "split_segments",
    "store_kv",
    "unified_launch",
    "uses_split_kv",
]

_LOG2E = 1.4426950408889634


@dataclass
class TritonAttentionConfig:
    """Launch parameters (all become constexpr / launch options; safe to change at runtime,
    each new combination just compiles a new kernel variant). ``CONFIG`` holds them for heads up
    to 128 wide, ``CONFIG_WIDE`` for wider ones (``config_for``)."""

    # Unified kernel, prefill-ish batches (max_query_len > 1): target rows per program
    # (query tokens x packed GQA heads) and KV positions per inner-loop tile.
    prefill_block_m: int = 64
    prefill_tile_n: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2
    # Unified kernel, decode batches (max_query_len == 1): one token x GQA group per program, KV
    # positions per inner-loop tile. 128 beat 64 and 256 over throughput.py's
    # decode steps replayed on the H200 (`python -m benchmarks attention_replay`; bf16 4.39 s against 4.55
    # and 5.44, float8 3.53 against 3.71 and 3.87).
    decode_tile_n: int = 128
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # Split-KV decode.
    split_tile_n: int = 64
    split_num_warps: int = 4
    split_num_stages: int = 2
    # Use split-KV when max_query_len == 1, a workspace is given and B * Hkv <= this.
    split_kv_max_programs: int = 128
    # Segments per sequence on the split-KV path: 0 cuts every sequence into the workspace's
    # ``num_segments``; above 0, into at least this many programs over the batch: ceil(target / (B *
    # Hkv)) segments rounded up to a power of two (at most the workspace's; where that is 1 the
    # unified kernel attends), so a large batch is not cut finer than it needs to fill the device.
    split_kv_target_programs: int = 0
    # store_kv
    store_num_warps: int = 4


CONFIG = TritonAttentionConfig()
# Heads wider than 128 (Gemma 2's 256): a 128-position K and V tile pair is 128 KB, two stages do
# not fit beside each other in shared memory, and one program per SM hides no latency. 64-position
# decode tiles beat 128 (4.22 s against 4.86 over the Gemma 2 2B workload's decode steps replayed on
# the H200) and 32; 8 warps or 1 or 3 stages did not help (docs/benchmarks.md, "Gemma 2 2B shape").
CONFIG_WIDE = TritonAttentionConfig(decode_tile_n=64)
_WIDE_HEAD = 128  # heads wider than this take CONFIG_WIDE


def config_for(head_d: int) -> TritonAttentionConfig:
    """The launch parameters of heads ``head_d`` wide."""
    return CONFIG if head_d <= _WIDE_HEAD else CONFIG_WIDE


def apply_overrides(config: TritonAttentionConfig, text: str) -> None:
    """Set fields of ``config`` from ``"field=value,field=value"`` (integers): how a tuning run
    (``benchmarks/probes/gemma2_decode.py``) tries a configuration in a whole engine without an
    edit. ``ValueError`` names an unknown field or a value that is not an integer."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in TritonAttentionConfig.__dataclass_fields__:
            raise ValueError(f"unknown attention config field {name!r} in {text!r}")
        try:
            setattr(config, name, int(value))
        except ValueError:
            raise ValueError(f"attention config field {name!r} takes an integer, got {value!r}") from None


# STEERABLE_ATTENTION_CONFIG / STEERABLE_ATTENTION_CONFIG_WIDE: "field=value,..." over the defaults
# above, for heads up to 128 wide and wider ones (tuning runs; unset in normal use).
apply_overrides(CONFIG, os.environ.get("STEERABLE_ATTENTION_CONFIG", ""))
apply_overrides(CONFIG_WIDE, os.environ.get("STEERABLE_ATTENTION_CONFIG_WIDE", ""))


class DecodeWorkspace:
    """Preallocated partial-result buffers for the split-KV decode path.

    Allocate once (outside CUDA-graph capture) for the largest decode batch; any call with
    ``B <= max_num_seqs`` can reuse it. Buffers are fp32:
    ``acc [max_num_seqs, Hq, num_segments, D_pad]``, ``max``/``sum [max_num_seqs, Hq, num_segments]``.
    """

    def __init__(self, max_num_seqs: int, num_q_heads: int, head_size: int, device,
                 num_segments: int = 16):
        if max_num_seqs < 1 or num_q_heads < 1 or head_size < 1 or num_segments < 1:
            raise ValueError("DecodeWorkspace sizes must be positive")
        self.max_num_seqs = int(max_num_seqs)
        self.num_q_heads = int(num_q_heads)
        self.head_size = int(head_size)
        self.head_size_padded = max(16, triton.next_power_of_2(head_size))
        self.num_segments = int(num_segments)
        self.device = torch.device(device)
        self.acc = torch.empty(
            (self.max_num_seqs, self.num_q_heads, self.num_segments, self.head_size_padded),
            dtype=torch.float32, device=self.device)
        self.max = torch.empty((self.max_num_seqs, self.num_q_heads, self.num_segments),
                               dtype=torch.float32, device=self.device)
        self.sum = torch.empty_like(self.max)


# --------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------

@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    k_scale, v_scale,
    NUM_HEADS: tl.constexpr, HEAD_D: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_D)
    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    if FP8:
        k = fused.to_fp8(k, k_scale, k_cache_ptr.dtype.element_ty)
        v = fused.to_fp8(v, v_scale, v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kco
             + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vco
             + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd, v, mask=mask)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
             slot_mapping: Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``k_cache``/``v_cache``
    ``[num_blocks, block_size, Hkv, D]`` (V of any strides) at ``slot_mapping`` (int64 ``[T]``; ``-1`` = skip); a
    float8 cache stores ``value / scale``, saturated, NaN as 0."""
    T = key.shape[0]
    if T == 0:
        return
    _, block_size, num_heads, head_d = k_cache.shape
    if key.shape[1:] != (num_heads, head_d) or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match "
                         f"cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache shapes differ")
    if slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows, expected {T}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    _store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        float(k_scale), float(v_scale),
        NUM_HEADS=num_heads, HEAD_D=head_d,
        H_PAD=triton.next_power_of_2(num_heads), D_PAD=triton.next_power_of_2(head_d), BLOCK_SIZE=block_size,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=CONFIG.store_num_warps,
    )


# --------------------------------------------------------------------------------------
# shared KV-tile step (online softmax update)
# --------------------------------------------------------------------------------------


@triton.jit
def _kv_tile_step(
    q, m_i, l_i, acc,
    tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    kv_head, kv_lo, kv_hi, q_pos, row_valid, qk_scale, softcap, window,
    offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    CAUSAL_PER_ROW: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, V_BY_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One KV tile: S = Q K^T, mask, online-softmax update of (m_i, l_i, acc).

    Keys outside ``[kv_lo, kv_hi)`` are never read. With ``CAUSAL_PER_ROW`` the causal (and
    window) limit is applied per query row from ``q_pos``; otherwise ``[kv_lo, kv_hi)`` is
    the exact key range for every row (split-KV decode). With ``SOFTCAP``, ``qk_scale`` is the
    plain scale over the cap and ``softcap`` the cap in the log2 domain: s = cap tanh(score / cap).
    """
    offs_n = tl.arange(0, TILE_N)
    k_pos = tile * TILE_N + offs_n
    k_valid = (k_pos < kv_hi) & (k_pos >= kv_lo)
    if TILE_N <= BLOCK_SIZE:
        # A tile never straddles a cache block: one block-table lookup per tile.
        phys = tl.load(bt_row_ptr + (tile * TILE_N) // BLOCK_SIZE).to(tl.int64)
        in_blk = (tile * TILE_N) % BLOCK_SIZE + offs_n
        blk_valid = tl.full([TILE_N], True, tl.int1)  # the tile's one block starts below kv_hi
    else:
        # Masked per block, not per position: the lookup then stays constant over a block's
        # positions, so a V cache laid out position-major loads a block's positions as one vector.
        blk_start = k_pos // BLOCK_SIZE * BLOCK_SIZE
        blk_valid = blk_start < kv_hi
        phys = tl.load(bt_row_ptr + k_pos // BLOCK_SIZE, mask=blk_valid, other=0).to(tl.int64)
        in_blk = k_pos % BLOCK_SIZE
    k_off = phys * stride_kb + in_blk * stride_ko + kv_head * stride_kh
    v_off = phys * stride_vb + in_blk * stride_vo + kv_head * stride_vh

    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                mask=k_valid[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [D_PAD, TILE_N]
    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N], log2 domain (k's scale folded in)
    if SOFTCAP:
        s = fused.tanh_exp2(s) * softcap

    mask = row_valid[:, None] & k_valid[None, :]
    if CAUSAL_PER_ROW:
        mask = mask & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            mask = mask & (k_pos[None, :] > q_pos[:, None] - window)
    s = tl.where(mask, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # Rows with no visible key yet keep m = -inf; use 0 as the shift so no NaN appears.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # A position-major V is masked per block, not per position, so that a block's positions load
    # as one vector: slots outside [kv_lo, kv_hi) are read and get p = 0, which needs them finite
    # (such a cache starts zeroed and its writers store finite values). Otherwise per position.
    v_rows = blk_valid if V_BY_BLOCK else k_valid
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :] * stride_vd,
                mask=v_rows[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [TILE_N, D_PAD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------
# unified prefill / decode kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    num_seqs, qk_scale, softcap, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    prefix_lens_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr, stride_wab, stride_wah, stride_wmb, stride_wmh,
    NUM_Q_PER_KV: tl.constexpr, GQA_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, ONE_TOKEN_PER_SEQ: tl.constexpr, FP16_TILES: tl.constexpr,
    V_BY_BLOCK: tl.constexpr, SOFTCAP: tl.constexpr, RESUME: tl.constexpr,
):
    # The KV heads of one query block are neighbouring programs: they read neighbouring bytes of
    # the same cache blocks at about the same time (measured ~2 % faster than blocks-fastest).
    pid_q = tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS

    if ONE_TOKEN_PER_SEQ:
        seq = pid_q  # a pure decode batch: query token b belongs to sequence b
    else:
        # Find the sequence owning this query block: the largest b with
        # qsl[b] // BLOCK_Q + b * (BLOCK_Q > 1) <= pid_q.
        lo = pid_q * 0
        hi = lo + num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            mid_start = tl.load(qsl_ptr + mid) // BLOCK_Q
            if BLOCK_Q > 1:
                mid_start += mid
            go_right = mid_start <= pid_q
            lo = tl.where(go_right, mid + 1, lo)
            hi = tl.where(go_right, hi, mid)
        seq = tl.maximum(lo - 1, 0)

    q_seq_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_seq_start
    seq_first_block = q_seq_start // BLOCK_Q
    if BLOCK_Q > 1:
        seq_first_block += seq
    q_off0 = (pid_q - seq_first_block) * BLOCK_Q
    surplus = (q_off0 < 0) | (q_off0 >= q_len)  # the grid is sized for the worst case
    if surplus:
        return

    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_D
    tok_in_blk = offs_m // GQA_PAD
    head_in_grp = offs_m % GQA_PAD
    q_idx = q_off0 + tok_in_blk  # query index within the sequence
    row_valid = (tok_in_blk < BLOCK_Q) & (head_in_grp < NUM_Q_PER_KV) & (q_idx < q_len)
    q_tok = (q_seq_start + q_idx).to(tl.int64)
    q_head = kv_head * NUM_Q_PER_KV + head_in_grp
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh
                + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if FP16_TILES:
        q = q.to(tl.float16)
    q_pos = ctx + q_idx  # absolute position of each row's token

    # Keys visible to any row of this block: [kv_lo, kv_hi).
    last_q = tl.minimum(q_off0 + BLOCK_Q, q_len) - 1
    kv_hi = tl.maximum(tl.minimum(ctx + last_q + 1, seq_len), 0)
    kv_lo = kv_hi * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx + q_off0 - window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = (kv_hi + TILE_N - 1) // TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    if RESUME:
        # A row of a shared-prefix group (one query token): the shared pass left its softmax state
        # after the prefix's tiles in workspace slot 0; going on from there is this loop unbroken.
        plen = tl.load(prefix_lens_ptr + seq)
        resume = row_valid & (offs_m * 0 + plen > 0)  # a vector compare: the interpreter's masks want one
        ws_row = seq.to(tl.int64) * stride_wmb + q_head * stride_wmh
        m_i = tl.load(ws_max_ptr + ws_row, mask=resume, other=float("-inf"))
        l_i = tl.load(ws_sum_ptr + ws_row, mask=resume, other=0.0)
        acc = tl.load(ws_acc_ptr + seq.to(tl.int64) * stride_wab + q_head[:, None] * stride_wah + offs_d[None, :],
                      mask=resume[:, None] & (offs_d[None, :] < D_PAD), other=0.0)
        tile_lo = tl.maximum(tile_lo, plen // TILE_N)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt

    for tile in range(tile_lo, tile_hi):
        m_i, l_i, acc = _kv_tile_step(
            q, m_i, l_i, acc, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_head, kv_lo, kv_hi, q_pos, row_valid, qk_scale, softcap, window, offs_d, d_mask,
            BLOCK_SIZE, TILE_N, True, USE_WINDOW, DOT_PREC, V_BY_BLOCK, SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None] * v_scale
    tl.store(out_ptr + q_tok[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


# --------------------------------------------------------------------------------------
# split-KV decode: partial kernel + reduce kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr,
    ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    qsl_ptr, seq_lens_ptr, block_table_ptr,
    qk_scale, softcap, window,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt,
    stride_wab, stride_wah, stride_was,
    stride_wmb, stride_wmh,
    NUM_Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, FP16_TILES: tl.constexpr, V_BY_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr, PDL: tl.constexpr,
):
    fused.pdl_enter(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_len <= 0:
        return  # padding sequence: the reduce kernel skips it too
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_D
    row_valid = offs_m < NUM_Q_PER_KV
    q_head = kv_head * NUM_Q_PER_KV + offs_m
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh
                + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if FP16_TILES:
        q = q.to(tl.float16)

    # The single query token sits at position seq_len - 1: keys [kv_lo, seq_len) are visible.
    kv_hi = tl.maximum(seq_len, 0)
    kv_lo = kv_hi * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(seq_len - window, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = (kv_hi + TILE_N - 1) // TILE_N
    tiles_per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    seg_lo = tile_lo + seg * tiles_per_seg
    seg_hi = tl.minimum(seg_lo + tiles_per_seg, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    q_pos = offs_m * 0  # unused (CAUSAL_PER_ROW=False)

    for tile in range(seg_lo, seg_hi):
        m_i, l_i, acc = _kv_tile_step(
            q, m_i, l_i, acc, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_head, kv_lo, kv_hi, q_pos, row_valid, qk_scale, softcap, window, offs_d, d_mask,
            BLOCK_SIZE, TILE_N, False, USE_WINDOW, DOT_PREC, V_BY_BLOCK, SOFTCAP)

    # Empty segments still write (m=-inf, l=0, acc=0) so the reduce never reads stale data.
    ws_head = seq.to(tl.int64) * stride_wmb + q_head * stride_wmh + seg
    tl.store(ws_max_ptr + ws_head, m_i, mask=row_valid)
    tl.store(ws_sum_ptr + ws_head, l_i, mask=row_valid)
    ws_acc = (seq.to(tl.int64) * stride_wab + q_head[:, None] * stride_wah + seg * stride_was
              + offs_d[None, :])
    tl.store(ws_acc_ptr + ws_acc, acc, mask=row_valid[:, None] & (offs_d[None, :] < D_PAD))


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr, qsl_ptr, v_scale,
    stride_ot, stride_oh,
    stride_wab, stride_wah, stride_was,
    stride_wmb, stride_wmh,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEG_PAD: tl.constexpr, PDL: tl.constexpr,
):
    fused.pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_len != 1:
        return  # padding, or (shared-prefix op of a mixed step) a prefill chunk the unified kernel attends
    offs_s = tl.arange(0, SEG_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SEGMENTS
    base = seq.to(tl.int64) * stride_wmb + head * stride_wmh
    m_s = tl.load(ws_max_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ws_sum_ptr + base + offs_s, mask=s_mask, other=0.0)
    m = tl.max(m_s, axis=0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(m_s - m_shift)  # 0 for empty segments
    denom = tl.sum(w * l_s, axis=0)
    acc = tl.load(ws_acc_ptr + seq.to(tl.int64) * stride_wab + head * stride_wah
                  + offs_s[:, None] * stride_was + offs_d[None, :],
                  mask=s_mask[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    num = tl.sum(w[:, None] * acc, axis=0)
    o = num / tl.where(denom == 0.0, 1.0, denom) * v_scale
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_D)


# --------------------------------------------------------------------------------------
# host entry point
# --------------------------------------------------------------------------------------


def split_segments(num_seqs: int, num_kv_heads: int, max_query_len: int, workspace: DecodeWorkspace | None,
                   head_d: int | None = None) -> int:
    """Segments per sequence where ``paged_attention`` attends this shape (heads ``head_d`` wide, by
    default the workspace's) with the split-KV kernels, 0 where the unified kernel attends it."""
    if max_query_len > 1 or workspace is None or num_seqs > workspace.max_num_seqs:
        return 0
    cfg = config_for(workspace.head_size if head_d is None else head_d)
    programs = num_seqs * num_kv_heads
    if programs > cfg.split_kv_max_programs:
        return 0
    if cfg.split_kv_target_programs <= 0:
        return workspace.num_segments
    # A power of two: a handful of kernel variants (each batch size of the graph ladder compiles one).
    segments = min(workspace.num_segments, triton.next_power_of_2(-(-cfg.split_kv_target_programs // max(programs, 1))))
    return segments if segments > 1 else 0


def uses_split_kv(num_seqs: int, num_kv_heads: int, max_query_len: int, workspace: DecodeWorkspace | None) -> bool:
    """Whether ``paged_attention`` attends this shape with the split-KV kernels (else the unified one)."""
    return split_segments(num_seqs, num_kv_heads, max_query_len, workspace) > 0


def score_scale(scale: float, k_scale: float, softcap: float | None) -> tuple[float, float, bool]:
    """(the kernels' ``qk_scale``, ``softcap``, whether capped): scores in the log2 domain, with a
    float8 cache's K / k_scale folded in; capped, tanh takes the natural-domain score over the cap
    and the cap (in log2) brings it back."""
    if softcap is not None and softcap > 0:
        return float(scale) * float(k_scale) / float(softcap), float(softcap) * _LOG2E, True
    return float(scale) * float(k_scale) * _LOG2E, 0.0, False


def unified_launch(head_d: int, gqa_pad: int, max_query_len: int) -> tuple[int, int, int, int, int]:
    """The unified kernel's (query tokens, rows, keys per tile, warps, stages) per program for this
    head size, padded GQA group and query-length hint. A row's scores and outputs come out of
    ``tl.dot`` with the same bits at any row count, but ``tl.sum`` over a tile's keys reduces in a
    layout that follows the tile's shape (measured on the H200: docs/benchmarks.md): a kernel that must
    reproduce this one's rows (the shared-prefix pass) uses the same rows and warps."""
    cfg = config_for(head_d)
    if max_query_len <= 1:
        block_q = 1
        tile_n = cfg.decode_tile_n
        num_warps, num_stages = cfg.decode_num_warps, cfg.decode_num_stages
    else:
        block_q = min(triton.next_power_of_2(max_query_len), max(1, cfg.prefill_block_m // gqa_pad))
        tile_n, num_warps, num_stages = cfg.prefill_tile_n, cfg.prefill_num_warps, cfg.prefill_num_stages
    return block_q, max(16, block_q * gqa_pad), tile_n, num_warps, num_stages


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact IEEE products (TF32 would break fp32 parity); ignored for 16-bit.
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor,
                    query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
                    max_query_len: int, scale: float, sliding_window: int | None = None,
                    workspace: "DecodeWorkspace | None" = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, softcap: float | None = None, prefix_lens: Tensor | None = None) -> None:
    """Causal paged attention over a ragged batch; writes ``out`` in place.

    ``q``/``out``: ``[T, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]`` (V of either
    layout above);
    ``query_start_loc`` int32 ``[B+1]``; ``seq_lens`` int32 ``[B]`` (context + new tokens);
    ``block_table`` int32 ``[B, max_blocks]``. Query row ``i`` of sequence ``b`` sits at
    position ``seq_lens[b] - query_len_b + i`` and sees keys at positions ``<=`` its own
    (and ``>`` own - ``sliding_window`` when set); ``softcap`` caps the scaled scores as
    ``softcap * tanh(score / softcap)`` before the mask (Gemma 2). Rows not covered by
    ``query_start_loc`` are not written; a row whose sequence sees no key (seq_len 0) gets 0.
    ``prefix_lens`` (int32 ``[>= B]``, with ``workspace``; the second launch of
    ``attention_backends.shared_prefix``): a sequence of one query token with a length ``> 0``
    resumes from the softmax state that op's shared pass left in workspace slot 0 after the whole
    tiles of that many keys; the unified kernel runs whatever the batch size.

    Path: split-KV decode when ``max_query_len <= 1`` and ``workspace`` is given and
    ``B * Hkv <= split_kv_max_programs`` of the head size's config and ``B <= workspace.max_num_seqs``
    (and, with ``split_kv_target_programs``, the batch wants more than one segment; then every
    sequence must have query_len <= 1); otherwise the unified kernel, which is correct for any
    ``max_query_len`` hint (the hint only shapes the tiles / grid), except that a hint of 1 with
    as many tokens as sequences is read as one token per sequence (no sequence lookup).
    Host-side decisions use only static values; run each static shape once before CUDA-graph
    capture so that Triton compiles outside the capture.
    """
    T, num_q_heads, head_d = q.shape
    _, block_size, num_kv_heads, head_d_k = k_cache.shape
    B = seq_lens.shape[0]
    if head_d_k != head_d or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if out.shape != q.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} not a multiple of Hkv={num_kv_heads}")
    if query_start_loc.shape[0] != B + 1 or block_table.shape[0] < B:
        raise ValueError("query_start_loc must be [B+1] and block_table [>=B, max_blocks]")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("block_table", block_table)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if v_cache.stride(-1) != 1 and v_cache.stride(1) != 1:
        raise ValueError("v_cache must be contiguous along its head dimension or its block positions")
    if T == 0 or B == 0:
        return

    cfg = config_for(head_d)
    group = num_q_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_d))
    qk_scale, cap_log2, use_softcap = score_scale(scale, k_scale, softcap)
    use_window = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if use_window else 0
    dot_prec = _dot_precision(q.dtype)
    # float8 tiles become float16 for a 16-bit query: one packed conversion per two values, where
    # bfloat16 takes two conversions per value (float8 -> float16 -> bfloat16).
    fp16_tiles = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    v_by_block = v_cache.stride(-1) != 1  # position-major V

    if prefix_lens is not None and (workspace is None or B > workspace.max_num_seqs or prefix_lens.shape[0] < B):
        raise ValueError("prefix_lens needs a workspace of B rows and a length per sequence")
    nseg = 0 if prefix_lens is not None else split_segments(B, num_kv_heads, max_query_len, workspace, head_d)
    if nseg:
        if workspace.num_q_heads != num_q_heads or workspace.head_size_padded < d_pad:
            raise ValueError("DecodeWorkspace was allocated for a different head layout")
        pdl_launch = fused.pdl_args(q)  # batch-1 decode is a chain of short kernels: each launches before the last ends
        _split_kv_decode_kernel[(B, num_kv_heads, nseg)](
            q, k_cache, v_cache, workspace.acc, workspace.max, workspace.sum,
            query_start_loc, seq_lens, block_table,
            qk_scale, cap_log2, window,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            block_table.stride(0),
            workspace.acc.stride(0), workspace.acc.stride(1), workspace.acc.stride(2),
            workspace.max.stride(0), workspace.max.stride(1),
            NUM_Q_PER_KV=group, BLOCK_M=max(16, gqa_pad),
            HEAD_D=head_d, D_PAD=d_pad,
            BLOCK_SIZE=block_size, TILE_N=cfg.split_tile_n, NUM_SEGMENTS=nseg,
            USE_WINDOW=use_window, DOT_PREC=dot_prec, FP16_TILES=fp16_tiles, V_BY_BLOCK=v_by_block,
            SOFTCAP=use_softcap, num_warps=cfg.split_num_warps, num_stages=cfg.split_num_stages, **pdl_launch,
        )
        _split_kv_reduce_kernel[(B, num_q_heads)](
            out, workspace.acc, workspace.max, workspace.sum, query_start_loc, float(v_scale),
            out.stride(0), out.stride(1),
            workspace.acc.stride(0), workspace.acc.stride(1), workspace.acc.stride(2),
            workspace.max.stride(0), workspace.max.stride(1),
            HEAD_D=head_d, D_PAD=d_pad,
            NUM_SEGMENTS=nseg, SEG_PAD=triton.next_power_of_2(nseg),
            num_warps=4, **pdl_launch,
        )
        return

    block_q, block_m, tile_n, num_warps, num_stages = unified_launch(head_d, gqa_pad, max_query_len)
    resume = prefix_lens is not None
    ws_args = ((prefix_lens, workspace.acc, workspace.max, workspace.sum, workspace.acc.stride(0),
                workspace.acc.stride(1), workspace.max.stride(0), workspace.max.stride(1)) if resume
               else (seq_lens, q, q, q, 0, 0, 0, 0))
    num_q_blocks = T if block_q == 1 else T // block_q + B
    _unified_attention_kernel[(num_q_blocks * num_kv_heads,)](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_table,
        B, qk_scale, cap_log2, float(v_scale), window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_table.stride(0), *ws_args,
        NUM_Q_PER_KV=group, GQA_PAD=gqa_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_D=head_d, D_PAD=d_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        USE_WINDOW=use_window, DOT_PREC=dot_prec,
        # At most one query token per sequence and as many tokens as sequences: exactly one each.
        NUM_KV_HEADS=num_kv_heads, ONE_TOKEN_PER_SEQ=max_query_len <= 1 and T == B, FP16_TILES=fp16_tiles,
        V_BY_BLOCK=v_by_block, SOFTCAP=use_softcap, RESUME=resume,
        num_warps=num_warps, num_stages=num_stages,
    )
