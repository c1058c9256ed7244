"""Fused Triton kernels for the per-token elementwise work of a decoder layer on CUDA.

Eager PyTorch spends several kernels on each RMSNorm, RoPE and SwiGLU; in a CUDA-graph decode step
those launches, not the bytes, set the time. Each op here is one kernel that reads its input once.
They round to the activation dtype at the same points as the PyTorch code they replace (and as HF),
so float32 results agree to rounding and bf16 results differ at most in the last bit.
The PyTorch implementations stay the CPU path and the reference in tests.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers use the PyTorch path
    triton = None


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, H, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = w * xhat.to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (act * up).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                             stride_qkv, stride_q, stride_k, stride_cos, eps,
                             NUM_Q: tl.constexpr, HEAD_D: tl.constexpr, HALF: tl.constexpr,
                             QK_NORM: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, HALF)
        mask = offs < HEAD_D // 2
        src = qkv_ptr + token * stride_qkv + head * HEAD_D
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HEAD_D // 2 + offs, mask=mask, other=0.0).to(tl.float32)
        if head < NUM_Q:
            dst = q_ptr + token * stride_q + head * HEAD_D
            w_ptr = qw_ptr
        else:
            dst = k_ptr + token * stride_k + (head - NUM_Q) * HEAD_D
            w_ptr = kw_ptr
        dtype = q_ptr.dtype.element_ty
        if QK_NORM:
            w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HEAD_D // 2 + offs, mask=mask, other=0.0).to(tl.float32)
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_D + eps)
            x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token)
        c = tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
        out1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
        out2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
        tl.store(dst + offs, out1.to(dtype), mask=mask)
        tl.store(dst + HEAD_D // 2 + offs, out2.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of a [N, H] (or [..., H]) tensor."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), shape[-1], eps,
                                         BLOCK=_pow2(shape[-1]), num_warps=4 if shape[-1] <= 4096 else 8)
    return y.view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate | up) -> [N, I]."""
    n, width = x.shape
    inter = width // 2
    y = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, _pow2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](x, y, x.stride(0), y.stride(0), inter, BLOCK=block,
                                                         num_warps=4)
    return y


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a fused qkv projection [T, (Hq + 2 Hkv) D] into q, k (optionally RMS-normed per head,
    then rotated) and a view of v, in one kernel for q and k."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    if tokens:
        norm = q_weight is not None
        _qk_norm_rope_kernel[(tokens, num_heads + num_kv_heads)](
            qkv, q, k, positions, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv,
            qkv.stride(0), q.stride(0), k.stride(0), cos.stride(0), eps,
            NUM_Q=num_heads, HEAD_D=head_dim, HALF=_pow2(head_dim // 2), QK_NORM=norm, num_warps=1)
    return q, k, v


if triton is not None:

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, temp_ptr, seed_ptr, out_ptr, stride, V, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        temp = tl.load(temp_ptr + row)
        seed = tl.load(seed_ptr + row)
        best_val = -float("inf")
        best_idx = 0
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < V
            x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=-float("inf"))
            if temp > 0:
                u = tl.rand(seed, offs)
                x = x / temp - tl.log(-tl.log(tl.maximum(u, 1e-20)))
                x = tl.where(mask, x, -float("inf"))
            value = tl.max(x, axis=0)
            index = tl.argmax(x, axis=0) + start
            better = value > best_val
            best_idx = tl.where(better, index, best_idx)
            best_val = tl.where(better, value, best_val)
        tl.store(out_ptr + row, best_idx)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One pass per row: argmax of logits (temperature 0) or of logits / T + Gumbel noise drawn from
    Philox(seed, vocab index), which samples softmax(logits / T) without materialising it."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, temperature, seeds, out, logits.stride(0), vocab, BLOCK=4096,
                                       num_warps=8)
    return out
