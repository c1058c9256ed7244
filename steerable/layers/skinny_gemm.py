"""``y = x W^T (+ b)`` for a few rows (a decode step's batch, 2 to 256 rows) as one Triton kernel.

At a decode batch the projections of a small model are skinny: 256 rows against 1024 to 6144
output features. cuBLAS tiles them 128 x 128 or so, which for o_proj (1024 outputs) is 16
programs on a 132-SM GPU: on the H200 it streamed o_proj's weights at 0.65 TB/s and down_proj's
at 0.8 TB/s inside a CUDA graph, against 4.3 TB/s for a device copy (``benchmarks/gemm_sweep.py``).
Here the output is tiled finer and the reduction dimension is split over ``SPLIT_K`` programs, so
every SM streams weights. Each program writes its float32 partial sum; the last of a tile's
programs to finish (an atomic counter, reset by that program, so the counters stay zero between
calls and CUDA-graph replays) adds the partials in a fixed order and rounds once: the result does
not depend on which program finished last.

With ``gated`` the input is ``act(gate) * up`` of an ``[M, 2K]`` gate|up tensor, computed as the
tiles load (the MLP's separate activation kernel goes away), rounded as ``fused.gated_mul``
rounds it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from steerable.layers import fused

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers use the PyTorch path
    triton = None


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


MAX_ROWS = 256  # above this cuBLAS's large tiles fill the GPU on their own
_COUNTERS = 1 << 14  # tile counters per device (a call needs one per output tile when split)


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_x, stride_w, stride_y,
                       HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU_TANH: tl.constexpr, IEEE: tl.constexpr,
                       PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * k_span
        k_hi = tl.minimum(K, k_lo + k_span)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_x
        # Under programmatic dependent launch, wait for the kernel before (it wrote x) before the
        # loop: the pipeliner prefetches the first iterations' loads ahead of the loop body, so a
        # wait inside it would come after x's first tiles were read.
        fused.pdl_enter(PDL)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            xm = m_mask[:, None] & k_mask[None, :]
            if GATED:
                gate = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
                up = tl.load(x_rows + K + offs_k[None, :], mask=xm, other=0.0).to(tl.float32)
                a = fused.gated_act(gate, up, w_ptr.dtype.element_ty, GELU_TANH)
            else:
                a = tl.load(x_rows + offs_k[None, :], mask=xm, other=0.0)
            if IEEE:  # float32 weights: no TF32 rounding, as F.linear
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        out_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K > 1:
            tile_elems = M * N
            part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
            tl.store(part + pid_k * tile_elems, acc, mask=out_mask)
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.debug_barrier()  # every thread's partial is stored before the release below
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # every partial of this tile is written and visible
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT_K):
                    acc += tl.load(part + s * tile_elems, mask=out_mask, other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + tile, 0)
                if HAS_BIAS:
                    acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=out_mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=out_mask)


_COUNTER_SETS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Zeroed tile counters, one set per device; every split call leaves them zero again. Made on
    the first (eager) call: memory allocated while a CUDA graph is captured belongs to its pool."""
    counters = _COUNTER_SETS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_linear: run it once eagerly before capturing it in a CUDA graph")
        counters = _COUNTER_SETS[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv.linear`` takes this kernel: a CUDA decode batch (2 to ``MAX_ROWS`` rows) in a
    16-bit dtype (float32 stays with cuBLAS, which computes it exactly), row-major operands."""
    return (triton is not None and x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.dim() == 2
            and weight.stride(1) == 1 and x.stride(1) == 1)


def pick_tiles(m: int, n: int, k: int) -> Tiles:
    """Tiles for ``m`` rows: the row block covers the batch (at most 64 rows), output tiles of 64,
    and the reduction split until about two programs per SM stream weights."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = 1
    while tiles * split_k * 2 <= 264 and k // (split_k * 2) >= 256:
        split_k *= 2
    return Tiles(block_m, block_n, 128, split_k)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: str | None = None,
                  tiles: Tiles | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [M, K] (M small) and ``weight`` [N, K]; with ``gated``
    ("silu" or "gelu_tanh") ``x`` is [M, 2K] (gate | up) and the input is ``act(gate) * up``."""
    m = x.shape[0]
    n, k = weight.shape
    t = tiles or pick_tiles(m, n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m), t.split_k)
    if t.split_k > 1:
        if grid[0] * grid[1] > _COUNTERS:
            raise ValueError(f"skinny_linear: {grid[0] * grid[1]} output tiles exceed the {_COUNTERS} counters")
        part, counters = torch.empty(t.split_k, m, n, dtype=torch.float32, device=x.device), _counters(x.device)
    else:
        part = counters = y
    _skinny_kernel[grid](x, weight, bias if bias is not None else weight, y, part, counters, m, n, k, x.stride(0),
                         weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, GATED=gated is not None,
                         GELU_TANH=gated == "gelu_tanh", IEEE=weight.dtype == torch.float32, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                         SPLIT_K=t.split_k, num_warps=t.num_warps, num_stages=t.num_stages, **fused.pdl_args(x))
    return y
