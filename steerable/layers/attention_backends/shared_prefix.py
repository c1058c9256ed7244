"""Shared-prefix (cascade) decode attention: one read of a common prefix for many decode rows.

When several decode rows of a step hold the same physical KV blocks at the start of their block
tables (the prefix cache handed them the same blocks), attention splits in two passes whose
partial softmax states are merged by their log-sum-exp:

* *shared pass*: a program owns ``BLOCK_Q`` decode rows x one GQA group (``BLOCK_M`` query rows of
  an MMA) and a share of the prefix tiles, so the prefix is read once per ``BLOCK_Q`` rows instead
  of once per row. The block ids come from the table row of the first member in the program's rows
  (members' leading blocks are identical by construction).
* *own pass*: a split-KV program per (row, KV head, segment) over the row's keys after its prefix.

Both write unnormalised partial outputs with their running max / sum into the split-KV workspace
(segments ``[0, shared_segments)`` and the rest), and ``triton_paged``'s split-KV reduce merges
them. ``prefix_lens[b]`` (int32, device) is the shared length of row b in tokens (a multiple of
the block size, below the row's current position), or 0 for rows outside the group: the step's
shape alone fixes the launches, so the op is CUDA-graph safe with the lengths in a persistent
buffer. Full attention only (a sliding window may start inside the prefix). In a step that mixes
prefill chunks with decode rows, this op attends the rows of one query token and the unified
kernel the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from steerable.layers.attention_backends import triton_paged as tp  # its tile step, reduce and config

__all__ = ["SHARED_SEGMENTS", "shared_prefix_attention"]

SHARED_SEGMENTS = 4  # prefix tiles split over this many programs per (row block, KV head)
_SHARED_BLOCK_M = 64  # query rows (decode rows x packed GQA heads) per shared-pass program
_OWN_MIN_PROGRAMS = 512  # own pass: segments per row until about this many programs run


@triton.jit
def _shared_pass_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    qsl_ptr, prefix_lens_ptr, block_table_ptr, num_seqs, qk_scale, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt, stride_wab, stride_wah, stride_was, stride_wmb, stride_wmh,
    NUM_Q_PER_KV: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, DOT_PREC: tl.constexpr, FP16_TILES: tl.constexpr, V_BY_BLOCK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_D
    head_in_grp = offs_m % GQA_PAD
    seq = tl.program_id(0) * BLOCK_Q + offs_m // GQA_PAD
    in_batch = (offs_m // GQA_PAD < BLOCK_Q) & (seq < num_seqs) & (head_in_grp < NUM_Q_PER_KV)
    plen = tl.load(prefix_lens_ptr + seq, mask=in_batch, other=0)
    member = in_batch & (plen > 0)
    shared_len = tl.max(plen, axis=0)  # every member has the same length; 0: no member here
    lead = tl.min(tl.where(member, seq, num_seqs), axis=0)
    lead = tl.minimum(lead, num_seqs - 1)

    q_tok = tl.load(qsl_ptr + seq, mask=in_batch, other=0).to(tl.int64)
    q_head = kv_head * NUM_Q_PER_KV + head_in_grp
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=member[:, None] & d_mask[None, :], other=0.0)
    if FP16_TILES:
        q = q.to(tl.float16)

    num_tiles = (shared_len + TILE_N - 1) // TILE_N
    per_seg = (num_tiles + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    seg_lo = seg * per_seg
    seg_hi = tl.minimum(seg_lo + per_seg, num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + lead.to(tl.int64) * stride_bt
    kv_lo = shared_len * 0
    for tile in range(seg_lo, seg_hi):
        m_i, l_i, acc = tp._kv_tile_step(
            q, m_i, l_i, acc, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_head, kv_lo, shared_len, offs_m * 0, member, qk_scale, softcap, 0, offs_d, d_mask,
            BLOCK_SIZE, TILE_N, False, False, DOT_PREC, V_BY_BLOCK, SOFTCAP)

    # Every row of the batch writes its segment (empty for non-members) so the reduce reads no stale data.
    seq64 = seq.to(tl.int64)
    ws_head = seq64 * stride_wmb + q_head * stride_wmh + seg
    tl.store(ws_max_ptr + ws_head, m_i, mask=in_batch)
    tl.store(ws_sum_ptr + ws_head, l_i, mask=in_batch)
    ws_acc = seq64[:, None] * stride_wab + q_head[:, None] * stride_wah + seg * stride_was + offs_d[None, :]
    tl.store(ws_acc_ptr + ws_acc, acc, mask=in_batch[:, None] & (offs_d[None, :] < D_PAD))


@triton.jit
def _own_pass_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    qsl_ptr, seq_lens_ptr, prefix_lens_ptr, block_table_ptr, qk_scale, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt, stride_wab, stride_wah, stride_was, stride_wmb, stride_wmh,
    NUM_Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SEG_OFFSET: tl.constexpr,
    DOT_PREC: tl.constexpr, FP16_TILES: tl.constexpr, V_BY_BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) - q_start != 1:
        return  # padding, or a mixed step's prefill chunk (the unified kernel's): the reduce skips it too
    kv_hi = tl.maximum(tl.load(seq_lens_ptr + seq), 0)
    kv_lo = tl.minimum(tl.load(prefix_lens_ptr + seq), kv_hi)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_D
    row_valid = offs_m < NUM_Q_PER_KV
    q_head = kv_head * NUM_Q_PER_KV + offs_m
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if FP16_TILES:
        q = q.to(tl.float16)

    tile_lo = kv_lo // TILE_N
    tile_hi = (kv_hi + TILE_N - 1) // TILE_N
    per_seg = (tile_hi - tile_lo + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    seg_lo = tile_lo + seg * per_seg
    seg_hi = tl.minimum(seg_lo + per_seg, tile_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(seg_lo, seg_hi):
        m_i, l_i, acc = tp._kv_tile_step(
            q, m_i, l_i, acc, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_head, kv_lo, kv_hi, offs_m * 0, row_valid, qk_scale, softcap, 0, offs_d, d_mask,
            BLOCK_SIZE, TILE_N, False, False, DOT_PREC, V_BY_BLOCK, SOFTCAP)

    slot = SEG_OFFSET + seg
    ws_head = seq.to(tl.int64) * stride_wmb + q_head * stride_wmh + slot
    tl.store(ws_max_ptr + ws_head, m_i, mask=row_valid)
    tl.store(ws_sum_ptr + ws_head, l_i, mask=row_valid)
    ws_acc = seq.to(tl.int64) * stride_wab + q_head[:, None] * stride_wah + slot * stride_was + offs_d[None, :]
    tl.store(ws_acc_ptr + ws_acc, acc, mask=row_valid[:, None] & (offs_d[None, :] < D_PAD))


def own_segments(num_seqs: int, num_kv_heads: int, workspace: tp.DecodeWorkspace) -> int:
    """Segments per row of the own pass: enough programs to fill the device, within the workspace."""
    want = -(-_OWN_MIN_PROGRAMS // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, workspace.num_segments - SHARED_SEGMENTS))


def shared_prefix_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, query_start_loc: Tensor,
                            seq_lens: Tensor, block_table: Tensor, prefix_lens: Tensor, scale: float,
                            workspace: tp.DecodeWorkspace, k_scale: float = 1.0, v_scale: float = 1.0,
                            softcap: float | None = None) -> None:
    """Decode attention (full attention) of every sequence with one query token, equal to
    ``triton_paged.paged_attention``'s, reading the prefix that the rows with ``prefix_lens[b] > 0``
    share once per block of rows. Same tensors as ``paged_attention`` plus ``prefix_lens`` int32
    ``[>= B]`` (and ``softcap`` as there); needs a workspace of ``B`` rows and more than
    ``SHARED_SEGMENTS`` segments. Sequences of several query tokens (a mixed step's prefill chunks,
    which ``paged_attention(..., skip_single=True)`` attends) are left unwritten and must have a
    prefix length of 0."""
    T, num_q_heads, head_d = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    B = seq_lens.shape[0]
    if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_d:
        raise ValueError("q, out and the caches do not match")
    if prefix_lens.shape[0] < B or block_table.shape[0] < B:
        raise ValueError("prefix_lens and block_table need a row per sequence")
    if B > workspace.max_num_seqs or workspace.num_segments <= SHARED_SEGMENTS:
        raise ValueError("DecodeWorkspace too small for shared-prefix attention")
    if workspace.num_q_heads != num_q_heads or workspace.head_size_padded < max(16, triton.next_power_of_2(head_d)):
        raise ValueError("DecodeWorkspace was allocated for a different head layout")
    if B == 0:
        return
    group = num_q_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_d))
    qk_scale = float(scale) * float(k_scale) * tp._LOG2E
    use_softcap = softcap is not None and softcap > 0  # as paged_attention: tanh of score / cap, cap in log2
    cap_log2 = float(softcap) * tp._LOG2E if use_softcap else 0.0
    if use_softcap:
        qk_scale = float(scale) * float(k_scale) / float(softcap)
    dot_prec = tp._dot_precision(q.dtype)
    fp16_tiles = k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
    v_by_block = v_cache.stride(-1) != 1
    ws = workspace
    ws_strides = (ws.acc.stride(0), ws.acc.stride(1), ws.acc.stride(2), ws.max.stride(0), ws.max.stride(1))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3))
    block_q = max(1, min(_SHARED_BLOCK_M // gqa_pad, triton.next_power_of_2(B)))
    block_m = max(16, block_q * gqa_pad)
    _shared_pass_kernel[(triton.cdiv(B, block_q), num_kv_heads, SHARED_SEGMENTS)](
        q, k_cache, v_cache, ws.acc, ws.max, ws.sum, query_start_loc, prefix_lens, block_table, B, qk_scale, cap_log2,
        q.stride(0), q.stride(1), *cache_strides, block_table.stride(0), *ws_strides,
        NUM_Q_PER_KV=group, GQA_PAD=gqa_pad, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_D=head_d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE_N=tp.CONFIG.split_tile_n, NUM_SEGMENTS=SHARED_SEGMENTS, DOT_PREC=dot_prec,
        FP16_TILES=fp16_tiles, V_BY_BLOCK=v_by_block, SOFTCAP=use_softcap, num_warps=4, num_stages=2,
    )
    nown = own_segments(B, num_kv_heads, ws)
    _own_pass_kernel[(B, num_kv_heads, nown)](
        q, k_cache, v_cache, ws.acc, ws.max, ws.sum, query_start_loc, seq_lens, prefix_lens, block_table, qk_scale, cap_log2,
        q.stride(0), q.stride(1), *cache_strides, block_table.stride(0), *ws_strides,
        NUM_Q_PER_KV=group, BLOCK_M=max(16, gqa_pad), HEAD_D=head_d, D_PAD=d_pad, BLOCK_SIZE=block_size,
        TILE_N=tp.CONFIG.split_tile_n, NUM_SEGMENTS=nown, SEG_OFFSET=SHARED_SEGMENTS, DOT_PREC=dot_prec,
        FP16_TILES=fp16_tiles, V_BY_BLOCK=v_by_block, SOFTCAP=use_softcap,
        num_warps=tp.CONFIG.split_num_warps, num_stages=tp.CONFIG.split_num_stages,
    )
    nseg = SHARED_SEGMENTS + nown
    tp._split_kv_reduce_kernel[(B, num_q_heads)](
        out, ws.acc, ws.max, ws.sum, query_start_loc, float(v_scale), out.stride(0), out.stride(1), *ws_strides,
        HEAD_D=head_d, D_PAD=d_pad, NUM_SEGMENTS=nseg, SEG_PAD=triton.next_power_of_2(nseg), PDL=False,
        num_warps=4,
    )
