"""Mixture-of-experts dispatch with static shapes: no host sync, so a CUDA graph can hold it.

The ``T * k`` (token, expert) assignments are laid out by expert, each expert's run padded to a
multiple of ``block_m`` (``moe_align``: two small kernels, one counting each expert's assignments,
one placing them; the layout's upper bound is known from ``T`` alone), and a grouped GEMM kernel
walks the blocks, each block multiplying its rows by its expert's weights; blocks past the used
length exit at once. Two launches per layer: gate-up with SwiGLU in its epilogue, then down with
the routing weight in its epilogue. Outputs stay in assignment order (token-major), so the caller
sums a token's ``k`` expert outputs exactly as the PyTorch path does. Rounding follows the PyTorch
path: each linear output is rounded to the activation dtype before SwiGLU or the routing weight.

Tile sizes come from a table keyed by the number of tokens (``moe_configs.py``; tuned per device
and shape by ``python -m benchmarks moe_tune``): small tiles for decode, where the weights' bytes set
the time, large ones for prefill, where the MMA does. Float32 always uses one configuration, so
its results do not depend on the batch size.

One token (a batch-1 decode step) skips the layout: its ``k`` assignments are known by position,
so two GEMV kernels stream the chosen experts' weights directly (``moe_gemv``), the second summing
the ``k`` weighted outputs itself. ``fused_moe`` picks the path and returns the token sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steerable.layers.fused import pdl_args
from steerable.layers.moe_configs import TileConfig, tile_configs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never take this path (fused.enabled is False)
    triton = None

_ALIGN_CHUNK = 1024  # assignments one program of the align kernels reads per iteration


def num_blocks(assignments: int, num_experts: int, block_m: int) -> int:
    """A static bound on the blocks the layout can use, whatever the routing: every expert with an
    assignment (at most ``min(E, T * k)`` of them) pads its run by fewer than ``block_m`` rows."""
    return -(-(assignments + min(num_experts, assignments) * (block_m - 1)) // block_m)


def moe_align_reference(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_align`` in tensor ops (any device; the kernels' oracle)."""
    flat = experts.reshape(-1)
    assignments = flat.numel()
    device = flat.device
    onehot = (flat[:, None] == torch.arange(num_experts, device=device)).to(torch.int32)
    rank = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1  # earlier assignments to the same expert
    counts = onehot.sum(0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    blocks = num_blocks(assignments, num_experts, block_m)
    dest = (ends - padded)[flat] + rank
    ids = torch.full((blocks * block_m,), assignments, dtype=torch.int32, device=device)
    ids.scatter_(0, dest, torch.arange(assignments, dtype=torch.int32, device=device))
    starts = torch.arange(blocks, device=device, dtype=ends.dtype) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return ids, block_expert


if triton is not None:
    from steerable.layers.fused import gated_act, pdl_enter

    @triton.jit
    def _moe_count_kernel(experts_ptr, counts_ptr, num_assignments, CHUNK: tl.constexpr):
        """Program e: how many assignments go to expert e."""
        e = tl.program_id(0)
        acc = tl.zeros((CHUNK,), dtype=tl.int32)
        for start in range(0, num_assignments, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            chosen = tl.load(experts_ptr + offs, mask=offs < num_assignments, other=-1)
            acc += (chosen == e).to(tl.int32)
        tl.store(counts_ptr + e, tl.sum(acc, 0))

    @triton.jit
    def _moe_place_kernel(experts_ptr, counts_ptr, ids_ptr, block_expert_ptr, num_assignments, total_blocks,
                          NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr):
        """Program e < E writes expert e's run (its assignments in ascending order, then padding)
        and the expert of each of its blocks; program E marks the blocks past the used length."""
        e = tl.program_id(0)
        offs_e = tl.arange(0, E_PAD)
        counts = tl.load(counts_ptr + offs_e, mask=offs_e < NUM_EXPERTS, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
        rows = tl.arange(0, BLOCK_M)
        chunk_blocks = tl.arange(0, BLOCKS_CHUNK)
        if e < NUM_EXPERTS:
            count = tl.sum(tl.where(offs_e == e, counts, 0), 0)
            run = tl.sum(tl.where(offs_e == e, padded, 0), 0)
            placed = count * 0
            for s in range(0, num_assignments, CHUNK):
                offs = s + tl.arange(0, CHUNK)
                hit = (tl.load(experts_ptr + offs, mask=offs < num_assignments, other=-1) == e).to(tl.int32)
                rank = placed + tl.cumsum(hit, 0) - hit
                tl.store(ids_ptr + start + rank, offs.to(tl.int32), mask=hit != 0)
                placed += tl.sum(hit, 0)
            tail = count + rows
            tl.store(ids_ptr + start + tail, num_assignments, mask=tail < run)
            first_block = start // BLOCK_M
            for own in range(0, run // BLOCK_M, BLOCKS_CHUNK):
                blocks = own + chunk_blocks
                tl.store(block_expert_ptr + first_block + blocks, e, mask=blocks < run // BLOCK_M)
        else:
            used = tl.sum(padded, 0) // BLOCK_M
            for unused in range(used, total_blocks, BLOCKS_CHUNK):
                spare = unused + chunk_blocks
                inside = spare < total_blocks
                tl.store(block_expert_ptr + spare, NUM_EXPERTS, mask=inside)
                slots = spare[:, None] * BLOCK_M + rows[None, :]
                tl.store(ids_ptr + slots, num_assignments, mask=inside[:, None])

    @triton.jit
    def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, ids_ptr, block_expert_ptr, N, K, num_assignments,
                         num_m_blocks, stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         NUM_EXPERTS: tl.constexpr, ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         SWIGLU: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[id] = A[id // ROWS_PER_A] @ B[e].T for the ids of one block, all of expert e; B is
        [E, N, K] (nn.Linear layout), or [E, 2N, K] (gate rows, then up rows) with ``SWIGLU``, when
        C[id] = silu(gate) * up. ``MUL_WEIGHT`` scales each row by its routing weight. Programs
        walk GROUP_M row blocks for each column block, so a column block of one expert's weights
        is read by that expert's row blocks while it is still in L2."""
        pid = tl.program_id(0)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = min(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        expert = tl.load(block_expert_ptr + pid_m)
        if expert >= NUM_EXPERTS:
            return
        ids = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_assignments
        rows = (ids // ROWS_PER_A).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            b_mask = (k[:, None] < K) & (offs_n[None, :] < N)
            b = tl.load(b_base + k[:, None] * stride_bk, mask=b_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            if SWIGLU:
                up = tl.load(b_base + N * stride_bn + k[:, None] * stride_bk, mask=b_mask, other=0.0)
                acc_up = tl.dot(a, up, acc_up, input_precision=DOT_PREC)
        dtype = c_ptr.dtype.element_ty
        if SWIGLU:
            out = gated_act(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype, False)
        else:
            out = acc.to(dtype)
        if MUL_WEIGHT:
            weight = tl.load(weight_ptr + ids, mask=valid, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) * weight[:, None]).to(dtype)
        tl.store(c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], out,
                 mask=valid[:, None] & (offs_n[None, :] < N))

    # The one-token kernels start with ``pdl_enter``: which weights to read is the routing kernel's
    # output, so under programmatic dependent launch only their launch latency hides, no loads.

    @triton.jit
    def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, experts_ptr, h_ptr, I, H, stride_we, stride_wn, PDL: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (j, b): features ``[b * BLOCK_N, +BLOCK_N)`` of assignment j's hidden vector
        ``silu(gate) * up``, gate and up being rows n and I + n of its expert's [2I, H] weights
        times x, each rounded to the activation dtype first (as the grouped kernel rounds)."""
        pdl_enter(PDL)
        j = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        expert = tl.load(experts_ptr + j).to(tl.int64)
        gate_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        up_rows = gate_rows + I * stride_wn
        acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < H
            mask = n_mask[:, None] & k_mask[None, :]
            gate = tl.load(gate_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(up_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            acc_gate += tl.sum(gate * x[None, :], axis=1)
            acc_up += tl.sum(up * x[None, :], axis=1)
        dtype = h_ptr.dtype.element_ty
        h = gated_act(acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), dtype, False)
        tl.store(h_ptr + j * I + offs_n, h, mask=n_mask)

    @triton.jit
    def _moe_gemv_down_kernel(h_ptr, w_ptr, experts_ptr, weights_ptr, y_ptr, H, I, stride_we, stride_wn,
                              TOP_K: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """Program b: output features ``[b * BLOCK_N, +BLOCK_N)`` of the token, the sum over its
        ``TOP_K`` assignments of (expert's down rows times its hidden vector, rounded) times the
        routing weight, rounded: the grouped kernel's epilogue, then one rounding of a float32 sum,
        as torch's ``sum`` of the k rows rounds. Each step loads a tile of every assignment's rows
        at once, so the k experts' weights stream concurrently rather than one after another."""
        pdl_enter(PDL)
        slots = tl.arange(0, K_PAD)
        used = slots < TOP_K
        experts = tl.load(experts_ptr + slots, mask=used, other=0).to(tl.int64)
        weight = tl.load(weights_ptr + slots, mask=used, other=0.0).to(tl.float32)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        rows = w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
        row_mask = used[:, None, None] & n_mask[None, :, None]
        acc = tl.zeros([K_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < I
            w = tl.load(rows + offs_k[None, None, :], mask=row_mask & k_mask[None, None, :], other=0.0)
            h = tl.load(h_ptr + slots[:, None] * I + offs_k[None, :], mask=used[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)
        dtype = y_ptr.dtype.element_ty
        y = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype).to(tl.float32)
        tl.store(y_ptr + offs_n, tl.sum(y, axis=0).to(dtype), mask=n_mask)


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignment ids laid out by expert [num_blocks * block_m], the sentinel ``T * k`` in padding;
    the expert of each block [num_blocks], ``num_experts`` for unused blocks). Assignment
    ``t * k + j`` is token t's j-th expert; within an expert they keep ascending order."""
    flat = experts.reshape(-1)
    assignments = flat.numel()
    blocks = num_blocks(assignments, num_experts, block_m)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    ids = torch.empty(blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    _moe_count_kernel[(num_experts,)](flat, counts, assignments, CHUNK=_ALIGN_CHUNK)
    _moe_place_kernel[(num_experts + 1,)](flat, counts, ids, block_expert, assignments, blocks,
                                          NUM_EXPERTS=num_experts, E_PAD=triton.next_power_of_2(num_experts),
                                          BLOCK_M=block_m, CHUNK=_ALIGN_CHUNK, BLOCKS_CHUNK=64)
    return ids, block_expert


def _grouped_gemm(a: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor,
                  num_assignments: int, rows_per_a: int, routing: torch.Tensor | None, swiglu: bool,
                  block_m: int, tile: TileConfig) -> torch.Tensor:
    """[num_assignments, N]: each assignment's row of ``a`` (row ``id // rows_per_a``) times its
    expert's ``weights[e]`` ([E, N, K]; with ``swiglu`` [E, 2N, K] gate | up, and the output is
    SwiGLU of the two), optionally scaled by ``routing[id]``."""
    num_experts, n, k = weights.shape
    n = n // 2 if swiglu else n
    out = torch.empty(num_assignments, n, dtype=a.dtype, device=a.device)
    m_blocks = block_expert.numel()
    grid = (m_blocks * triton.cdiv(n, tile.block_n),)
    _moe_gemm_kernel[grid](a, weights, out, routing if routing is not None else a, ids, block_expert, n, k,
                           num_assignments, m_blocks, a.stride(0), weights.stride(0), weights.stride(1),
                           weights.stride(2), out.stride(0), NUM_EXPERTS=num_experts, ROWS_PER_A=rows_per_a,
                           MUL_WEIGHT=routing is not None, SWIGLU=swiglu,
                           DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
                           BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
                           num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def fused_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, configs: tuple[int, TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """Every assignment's weighted expert output [T * k, H], in assignment order: x [T, H], experts
    and weights [T, k], gate_up [E, 2I, H], down [E, H, I]. ``configs`` = (block_m, gate-up tile,
    down tile) overrides the table (tuning, tests)."""
    num_tokens, top_k = experts.shape
    assignments = num_tokens * top_k
    num_experts = gate_up.shape[0]
    if configs is None:
        configs = tile_configs(num_tokens, num_experts, x.shape[1], down.shape[2], x.dtype, x.device)
    block_m, gate_up_tile, down_tile = configs
    ids, block_expert = moe_align(experts, num_experts, block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    hidden = _grouped_gemm(x, gate_up, ids, block_expert, assignments, top_k, None, True, block_m, gate_up_tile)
    return _grouped_gemm(hidden, down, ids, block_expert, assignments, 1, weights.reshape(-1).contiguous(), False,
                         block_m, down_tile)


@dataclass(frozen=True)
class GemvTile:
    """One MoE GEMV launch: ``block_n`` weight rows per program (per half, gate and up, in the
    gate-up kernel), streamed ``block_k`` columns at a time; Triton's ``num_warps`` / ``num_stages``."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Starting points for the decode shape of Qwen3-30B-A3B (H 2048, I 768, k 8), to be tuned on the
# device. Both kernels only stream weights (32 KB per gate-up program, 48 KB per down program), so
# what matters is enough programs, and loads in flight, to keep every SM loading: gate-up gets
# k * I / 4 = 1,536 programs, each loading two 4 x 1024 tiles per step (the dense GEMV's
# wide-output tile, 8 x 1024); down gets H / 4 = 512, each loading k x 4 x 256 per step (as many
# elements, 3 steps for I = 768 with no masked lanes).
GEMV_GATE_UP = GemvTile(block_n=4, block_k=1024)
GEMV_DOWN = GemvTile(block_n=4, block_k=256)


def gemv_eligible(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``fused_moe`` takes the one-token kernels: one token, row-major weights, and not
    float32, whose results must not depend on the batch (the grouped GEMM's reduction order)."""
    return x.shape[0] == 1 and x.dtype != torch.float32 and gate_up.stride(-1) == 1 and down.stride(-1) == 1


def moe_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, tiles: tuple[GemvTile, GemvTile] | None = None) -> torch.Tensor:
    """One token's summed expert output [1, H]: x [1, H], experts and weights [1, k], gate_up
    [E, 2I, H], down [E, H, I]. Two launches and no layout; ``tiles`` (gate-up, down) overrides
    ``GEMV_GATE_UP`` / ``GEMV_DOWN`` (tuning)."""
    gate_up_tile, down_tile = tiles or (GEMV_GATE_UP, GEMV_DOWN)
    top_k = experts.shape[1]
    hidden_size, inter = down.shape[1], down.shape[2]
    experts = experts.reshape(-1).contiguous()
    weights = weights.reshape(-1).contiguous()
    x = x.contiguous()
    hidden = torch.empty(top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden_size, dtype=x.dtype, device=x.device)
    pdl = pdl_args(x)
    _moe_gemv_gate_up_kernel[(top_k, triton.cdiv(inter, gate_up_tile.block_n))](
        x, gate_up, experts, hidden, inter, hidden_size, gate_up.stride(0), gate_up.stride(1),
        BLOCK_N=gate_up_tile.block_n, BLOCK_K=min(gate_up_tile.block_k, triton.next_power_of_2(hidden_size)),
        num_warps=gate_up_tile.num_warps, num_stages=gate_up_tile.num_stages, **pdl)
    _moe_gemv_down_kernel[(triton.cdiv(hidden_size, down_tile.block_n),)](
        hidden, down, experts, weights, out, hidden_size, inter, down.stride(0), down.stride(1), TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), BLOCK_N=down_tile.block_n,
        BLOCK_K=min(down_tile.block_k, triton.next_power_of_2(inter)), num_warps=down_tile.num_warps,
        num_stages=down_tile.num_stages, **pdl)
    return out


def fused_moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, configs: tuple[int, TileConfig, TileConfig] | None = None,
              tiles: tuple[GemvTile, GemvTile] | None = None) -> torch.Tensor:
    """Each token's weighted sum of its expert outputs [T, H] (arguments as ``fused_experts``): the
    one-token kernels where ``gemv_eligible``, else the grouped GEMMs and a sum over the k outputs,
    which rounds once from float32 as the down kernel does. ``configs`` / ``tiles`` override the
    grouped / one-token launch configurations."""
    if gemv_eligible(x, gate_up, down):
        return moe_gemv(x, experts, weights, gate_up, down, tiles)
    num_tokens, top_k = experts.shape
    return fused_experts(x, experts, weights, gate_up, down, configs).view(num_tokens, top_k, -1).sum(dim=1)
