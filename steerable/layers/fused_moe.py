"""Mixture-of-experts dispatch with static shapes: no host sync, so a CUDA graph can hold it.

The ``T * k`` (token, expert) assignments are laid out by expert, each expert's run padded to a
multiple of ``BLOCK_M`` (``moe_align``, a handful of tensor ops of fixed shapes: the layout's upper
bound ``T * k + E * (BLOCK_M - 1)`` is known from ``T`` alone), and one grouped GEMM kernel walks
the blocks, each block multiplying its rows by its expert's weights; blocks past the used length
exit at once. Outputs stay in assignment order (token-major), so the caller sums a token's ``k``
expert outputs exactly as the PyTorch path does. Rounding follows the PyTorch path: each linear
output is rounded to the activation dtype before the routing weight multiplies it.
"""

from __future__ import annotations

import torch

from steerable.layers.activation import silu_and_mul

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never take this path (fused.enabled is False)
    triton = None

BLOCK_M = 16  # assignments per block: about what one expert gets per decode step at batch 256 and k/E = 1/16


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignment ids laid out by expert [num_blocks * block_m], the sentinel ``T * k`` in padding;
    the expert of each block [num_blocks], ``num_experts`` for unused blocks). Assignment
    ``t * k + j`` is token t's j-th expert; within an expert they keep ascending order."""
    flat = experts.reshape(-1)
    assignments = flat.numel()
    device = flat.device
    onehot = (flat[:, None] == torch.arange(num_experts, device=device)).to(torch.int32)
    rank = onehot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1  # earlier assignments to the same expert
    counts = onehot.sum(0)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    num_blocks = -(-(assignments + num_experts * (block_m - 1)) // block_m)
    dest = (ends - padded)[flat] + rank
    ids = torch.full((num_blocks * block_m,), assignments, dtype=torch.int32, device=device)
    ids.scatter_(0, dest, torch.arange(assignments, dtype=torch.int32, device=device))
    starts = torch.arange(num_blocks, device=device, dtype=ends.dtype) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return ids, block_expert


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, ids_ptr, block_expert_ptr, N, K, num_assignments,
                         stride_am, stride_be, stride_bn, stride_bk, stride_cm,
                         NUM_EXPERTS: tl.constexpr, ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """C[id] = A[id // ROWS_PER_A] @ B[e].T (times the routing weight of id) for the ids of block
        pid_m, all of expert e; B is [E, N, K] (nn.Linear layout)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
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
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            b = tl.load(b_base + k[:, None] * stride_bk, mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        dtype = c_ptr.dtype.element_ty
        out = acc.to(dtype)
        if MUL_WEIGHT:
            weight = tl.load(weight_ptr + ids, mask=valid, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) * weight[:, None]).to(dtype)
        tl.store(c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], out,
                 mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor,
                  num_assignments: int, rows_per_a: int, routing: torch.Tensor | None) -> torch.Tensor:
    """[num_assignments, N]: each assignment's row of ``a`` (row ``id // rows_per_a``) times its
    expert's ``weights[e]`` ([E, N, K]), optionally scaled by ``routing[id]``."""
    num_experts, n, k = weights.shape
    out = torch.empty(num_assignments, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, weights, out, routing if routing is not None else a, ids, block_expert, n, k,
                           num_assignments, a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2),
                           out.stride(0), NUM_EXPERTS=num_experts, ROWS_PER_A=rows_per_a,
                           MUL_WEIGHT=routing is not None,
                           DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
                           BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def fused_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """Every assignment's weighted expert output [T * k, H], in assignment order: x [T, H], experts
    and weights [T, k], gate_up [E, 2I, H], down [E, H, I]. Two grouped GEMMs and SwiGLU."""
    num_tokens, top_k = experts.shape
    assignments = num_tokens * top_k
    ids, block_expert = moe_align(experts, gate_up.shape[0])
    x = x if x.stride(-1) == 1 else x.contiguous()
    hidden = silu_and_mul(_grouped_gemm(x, gate_up, ids, block_expert, assignments, top_k, None))
    return _grouped_gemm(hidden, down, ids, block_expert, assignments, 1, weights.reshape(-1).contiguous())
