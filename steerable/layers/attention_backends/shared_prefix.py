"""Shared-prefix (cascade) decode attention: one read of a common prefix for many decode rows,
with the unshared kernel's result bit for bit.

When several decode rows of a step hold the same physical KV blocks at the start of their block
tables (the prefix cache handed them the same blocks), attention runs in two launches:

* *shared pass*: a program owns ``BLOCK_Q`` decode rows x one GQA group (``BLOCK_M`` query rows of
  an MMA, as many as a unified-kernel program of the step has) and walks the prefix's tiles in
  order, so the prefix is read once per ``BLOCK_Q`` rows instead of once per row. The block ids
  come from the table row of the first member in the program's rows (members' leading blocks are
  identical by construction). Each member's online-softmax state after the prefix's whole tiles
  (running max, sum, unnormalised output) goes to slot 0 of the split-KV workspace.
* *resume*: ``triton_paged``'s unified kernel, which every other row runs from its first key,
  starts each member from that state at the first tile after them.

The two launches perform the unified kernel's own arithmetic in its own order: the same tiles, the
same tile step, and programs of the same shape (rows, warps), so that ``tl.sum`` over a tile
reduces in the same layout (``tl.dot`` alone gives a row the same bits at any row count;
``tl.sum`` does not, on the H200: docs/benchmarks.md). So the output equals
``paged_attention``'s exactly wherever that uses the unified kernel. Where it would use split-KV (a
decode batch of ``B * Hkv <= CONFIG.split_kv_max_programs``, whose segments cut the keys
differently per row) nothing is shared: ``shares`` says which, and the op is ``paged_attention``
there.

``prefix_lens[b]`` (int32, device) is the shared length of row b in tokens (below the row's
current position), or 0 for rows outside the group: the step's shape alone fixes the launches, so
the op is CUDA-graph safe with the lengths in a persistent buffer. Full attention only (a sliding
window may start inside the prefix). A step that mixes prefill chunks with decode rows shares
among its decode rows; the chunks run in the same unified launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from steerable.layers.attention_backends import triton_paged as tp  # its tile step, config and unified kernel

__all__ = ["shared_prefix_attention", "shares"]


@triton.jit
def _shared_pass_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    qsl_ptr, prefix_lens_ptr, block_table_ptr, num_seqs, qk_scale, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt, stride_wab, stride_wah, stride_wmb, stride_wmh,
    NUM_Q_PER_KV: tl.constexpr, GQA_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr, FP16_TILES: tl.constexpr, V_BY_BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    kv_head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_D
    head_in_grp = offs_m % GQA_PAD
    seq = tl.program_id(0) * BLOCK_Q + offs_m // GQA_PAD
    in_batch = (offs_m // GQA_PAD < BLOCK_Q) & (seq < num_seqs) & (head_in_grp < NUM_Q_PER_KV)
    plen = tl.load(prefix_lens_ptr + seq, mask=in_batch, other=0)
    member = in_batch & (plen > 0)
    shared_len = tl.max(plen, axis=0)  # every member has the same length; 0: no member here
    if shared_len == 0:
        return
    lead = tl.min(tl.where(member, seq, num_seqs), axis=0)

    q_tok = tl.load(qsl_ptr + seq, mask=in_batch, other=0).to(tl.int64)
    q_head = kv_head * NUM_Q_PER_KV + head_in_grp
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                mask=member[:, None] & d_mask[None, :], other=0.0)
    if FP16_TILES:
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row_ptr = block_table_ptr + lead.to(tl.int64) * stride_bt
    kv_lo = shared_len * 0
    for tile in range(0, shared_len // TILE_N):
        m_i, l_i, acc = tp._kv_tile_step(
            q, m_i, l_i, acc, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, stride_vd,
            kv_head, kv_lo, shared_len, offs_m * 0, member, qk_scale, softcap, 0, offs_d, d_mask,
            BLOCK_SIZE, TILE_N, False, False, DOT_PREC, V_BY_BLOCK, SOFTCAP)

    # Members only: the unified kernel reads slot 0 of the rows whose prefix length is above 0.
    seq64 = seq.to(tl.int64)
    ws_head = seq64 * stride_wmb + q_head * stride_wmh
    tl.store(ws_max_ptr + ws_head, m_i, mask=member)
    tl.store(ws_sum_ptr + ws_head, l_i, mask=member)
    ws_acc = seq64[:, None] * stride_wab + q_head[:, None] * stride_wah + offs_d[None, :]
    tl.store(ws_acc_ptr + ws_acc, acc, mask=member[:, None] & (offs_d[None, :] < D_PAD))


def shares(num_seqs: int, num_kv_heads: int, max_query_len: int, workspace: tp.DecodeWorkspace | None) -> bool:
    """Whether a step of this shape shares its prefix (the unshared kernel would be the unified
    one, which the two launches reproduce); otherwise the op is ``paged_attention``."""
    return (workspace is not None and num_seqs <= workspace.max_num_seqs
            and not tp.uses_split_kv(num_seqs, num_kv_heads, max_query_len, workspace))


def shared_prefix_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, query_start_loc: Tensor,
                            seq_lens: Tensor, block_table: Tensor, max_query_len: int, prefix_lens: Tensor,
                            scale: float, workspace: tp.DecodeWorkspace, k_scale: float = 1.0, v_scale: float = 1.0,
                            softcap: float | None = None) -> None:
    """Full (causal) attention of a ragged batch, bit-identical to ``triton_paged.paged_attention``
    with the same arguments, reading the prefix that the rows with ``prefix_lens[b] > 0`` share once
    per block of rows where ``shares`` holds. Same tensors as ``paged_attention`` plus
    ``prefix_lens`` int32 ``[>= B]``: members have one query token and the same leading blocks for
    that many tokens, below their length; other rows have 0."""
    T, num_q_heads, head_d = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    B = seq_lens.shape[0]
    if prefix_lens.shape[0] < B or block_table.shape[0] < B:
        raise ValueError("prefix_lens and block_table need a row per sequence")
    common = dict(workspace=workspace, k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    if not shares(B, num_kv_heads, max_query_len, workspace):
        tp.paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, max_query_len, scale,
                           **common)
        return
    if out.shape != q.shape or v_cache.shape != k_cache.shape or k_cache.shape[3] != head_d:
        raise ValueError("q, out and the caches do not match")
    if workspace.num_q_heads != num_q_heads or workspace.head_size_padded < max(16, triton.next_power_of_2(head_d)):
        raise ValueError("DecodeWorkspace was allocated for a different head layout")
    if B == 0:
        return
    group = num_q_heads // num_kv_heads
    gqa_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_d))
    qk_scale, cap_log2, use_softcap = tp.score_scale(scale, k_scale, softcap)
    ws = workspace
    _, block_m, tile_n, num_warps, num_stages = tp.unified_launch(head_d, gqa_pad, max_query_len)
    block_q = block_m // gqa_pad
    _shared_pass_kernel[(triton.cdiv(B, block_q), num_kv_heads)](
        q, k_cache, v_cache, ws.acc, ws.max, ws.sum, query_start_loc, prefix_lens, block_table, B, qk_scale, cap_log2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3), block_table.stride(0),
        ws.acc.stride(0), ws.acc.stride(1), ws.max.stride(0), ws.max.stride(1),
        NUM_Q_PER_KV=group, GQA_PAD=gqa_pad, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_D=head_d,
        D_PAD=d_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        DOT_PREC=tp._dot_precision(q.dtype),
        FP16_TILES=k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32,
        V_BY_BLOCK=v_cache.stride(-1) != 1, SOFTCAP=use_softcap, num_warps=num_warps, num_stages=num_stages,
    )
    tp.paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, max_query_len, scale,
                       prefix_lens=prefix_lens, **common)
