"""Kernels on the logits: Gemma's final soft-cap in place, and the fused Gumbel-max sampler, which
reads the logits once in their own dtype and can apply that cap in its registers instead.

The soft-cap rounds where HF's three PyTorch ops round (``tanh(logits / cap) * cap``), so every path
gives the logits HF gives; the sampler's capped values are the in-place kernel's, bit for bit.
"""

from __future__ import annotations

import torch

from steerable.layers import fused

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs: callers use the PyTorch path
    triton = None


if triton is not None:

    @triton.jit
    def softcap_value(x, inv_cap, cap, dtype: tl.constexpr, LIBDEVICE: tl.constexpr):
        """``cap * tanh(x / cap)`` of float32 ``x`` (holding a value of ``dtype``) rounded where the
        three PyTorch ops round (HF's ``tanh(logits / cap) * cap``): CUDA divides by a scalar as
        ``x * (1 / cap)``, then tanh, then ``* cap``, each rounded to ``dtype``. LIBDEVICE: CUDA's
        ``tanhf``, what PyTorch's tanh calls; the interpreter has no libdevice (``tanh_exp2``)."""
        y = (x * inv_cap).to(dtype).to(tl.float32)
        if LIBDEVICE:
            t = libdevice.tanh(y)
        else:
            t = fused.tanh_exp2(y)
        return (t.to(dtype).to(tl.float32) * cap).to(dtype).to(tl.float32)

    @triton.jit
    def _softcap_kernel(x_ptr, n, inv_cap, cap, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + offs, softcap_value(x, inv_cap, cap, dtype, LIBDEVICE).to(dtype), mask=mask)

    @triton.jit
    def _race_step(logits_ptr, offs, V, temp, u, best_val, best_idx, inv_cap, cap, SOFTCAP: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
        """Fold the vocabulary entries ``offs`` (with uniforms ``u``) into the running best; ties
        go to the lowest index, as ``torch.argmax`` breaks them. SOFTCAP: the logits are capped
        first, as ``softcap_`` caps them (the same rounding)."""
        mask = offs < V
        x = tl.load(logits_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if SOFTCAP:
            x = tl.where(mask, softcap_value(x, inv_cap, cap, logits_ptr.dtype.element_ty, LIBDEVICE), -float("inf"))
        if temp > 0:
            x = tl.where(mask, x / temp - tl.log(-tl.log(tl.maximum(u, 1e-20))), -float("inf"))
        value = tl.max(x, axis=0)
        index = tl.min(tl.where(x == value, offs, V), axis=0)
        better = (value > best_val) | ((value == best_val) & (index < best_idx))
        return tl.where(better, value, best_val), tl.where(better, index, best_idx)

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, temp_ptr, seed_ptr, val_ptr, idx_ptr, stride, V, inv_cap, cap,
                              CHUNK: tl.constexpr, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
                              LIBDEVICE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        temp = tl.load(temp_ptr + row)
        seed = tl.load(seed_ptr + row)
        row_ptr = logits_ptr + row * stride
        best_val = -float("inf")
        best_idx = V
        for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, V), 4 * BLOCK):
            # One Philox draw gives the uniforms of four neighbouring entries: index 4i + k gets
            # lane k of counter i.
            base = start + 4 * tl.arange(0, BLOCK)
            u0, u1, u2, u3 = tl.rand4x(seed, base // 4)
            best_val, best_idx = _race_step(row_ptr, base, V, temp, u0, best_val, best_idx, inv_cap, cap, SOFTCAP,
                                            LIBDEVICE)
            best_val, best_idx = _race_step(row_ptr, base + 1, V, temp, u1, best_val, best_idx, inv_cap, cap,
                                            SOFTCAP, LIBDEVICE)
            best_val, best_idx = _race_step(row_ptr, base + 2, V, temp, u2, best_val, best_idx, inv_cap, cap,
                                            SOFTCAP, LIBDEVICE)
            best_val, best_idx = _race_step(row_ptr, base + 3, V, temp, u3, best_val, best_idx, inv_cap, cap,
                                            SOFTCAP, LIBDEVICE)
        chunks = tl.num_programs(1)
        tl.store(val_ptr + row * chunks + chunk, best_val)
        tl.store(idx_ptr + row * chunks + chunk, best_idx)


_GUMBEL_CHUNK = 8192


def _reciprocal(cap: float) -> float:
    """``1 / cap`` in float32, as CUDA's division of a tensor by a Python scalar computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(cap, dtype=torch.float32))


def softcap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in place (Gemma's final logit soft-cap), one read and one write
    of the logits where HF's three ops make three of each; rounded as those ops round (on CUDA the
    same values; the interpreter's tanh differs from ``tanhf`` by about 1e-7). Contiguous logits."""
    if not logits.is_contiguous():
        raise ValueError("softcap_ takes contiguous logits")
    n = logits.numel()
    if n:
        block = 4096
        _softcap_kernel[(triton.cdiv(n, block),)](logits, n, _reciprocal(cap), float(cap), BLOCK=block,
                                                  LIBDEVICE=not fused.INTERPRETED, num_warps=8)
    return logits


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """Argmax of logits (temperature 0) or of logits / T + Gumbel noise drawn from Philox(seed, vocab
    index), which samples softmax(logits / T) without materialising it. Logits are read once in
    their own dtype (upcast in registers); the vocabulary is split into chunks so a small batch
    still fills the GPU, and the per-chunk winners are reduced (ties go to the lowest index).
    ``softcap``: the logits are soft-capped first, with ``softcap_``'s values, in registers."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, _GUMBEL_CHUNK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    if not rows:
        return indices[:, 0]
    capped = softcap is not None and softcap > 0
    _gumbel_argmax_kernel[(rows, chunks)](logits, temperature, seeds, values, indices, logits.stride(0), vocab,
                                          _reciprocal(softcap) if capped else 1.0, float(softcap or 0.0),
                                          CHUNK=_GUMBEL_CHUNK, BLOCK=512, SOFTCAP=capped,
                                          LIBDEVICE=not fused.INTERPRETED, num_warps=4)
    return indices.gather(1, values.argmax(1, keepdim=True)).squeeze(1)
