"""Fused Triton kernels for the per-token elementwise work of a decoder layer on CUDA.

Eager PyTorch spends several kernels on each RMSNorm, RoPE and gated activation (SwiGLU, GeGLU); in
a CUDA-graph decode step those launches, not the bytes, set the time. Each op here is one kernel
that reads its input once.
They round to the activation dtype at the same points as the PyTorch code they replace (and as HF),
so float32 results agree to rounding and bf16 results differ at most in the last bit.
The PyTorch implementations stay the CPU path and the reference in tests.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from steerable.hook_points import SiteWrite

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers use the PyTorch path
    triton = None

# Tests only: with Triton's CPU interpreter (TRITON_INTERPRET=1), STEERABLE_FUSED_ON_CPU=1 sends CPU
# tensors down the fused path too, so a machine without a GPU still exercises these kernels in a model.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")  # Triton's CPU interpreter runs the kernels
_ON_CPU = os.environ.get("STEERABLE_FUSED_ON_CPU") == "1" and INTERPRETED


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _ON_CPU)


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the
# kernel before it still runs, and waits (``pdl_enter``) before it reads that kernel's output. At
# batch 1 a decode step is a chain of short kernels (norm, projection, rope, attention, ...): their
# launch latency hides behind the kernel before, and the GEMVs load their weights meanwhile.
# STEERABLE_PDL=0 turns it off.
_PDL_ALLOWED = (os.environ.get("STEERABLE_PDL", "1") != "0" and triton is not None
                and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait"))


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device launch with programmatic dependent launch."""
    return _PDL_ALLOWED and x.is_cuda and _hopper_or_later(x.device.index or 0)


def pdl_args(x: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel that calls ``pdl_enter``: its ``PDL`` constexpr and, when set,
    the launch option that goes with it."""
    return {"PDL": True, "launch_pdl": True} if pdl(x) else {"PDL": False}


if triton is not None:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """Under programmatic dependent launch: wait until the kernel before has finished (its
        writes visible), then let the next kernel launch. Trigger after the wait, so a kernel that
        starts early only ever overlaps its direct predecessor. Reads of that predecessor's
        output go after this; loads of what no kernel writes (weights) may go before."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def to_fp8(x, scale, dtype: tl.constexpr):
        """A float8 (e4m3) cache's entry for ``x``: ``x / scale`` saturated at the format's largest
        value, 448, and NaN stored as 0: every entry is finite, which attention over a
        position-major V relies on (it reads whole blocks and weights the slots it must skip 0)."""
        y = x.to(tl.float32) / scale
        return tl.clamp(tl.where(y == y, y, 0.0), -448.0, 448.0).to(dtype)

    @triton.jit
    def tanh_exp2(x):
        """tanh from one exp2 (no libdevice call, so the CPU interpreter runs it too); absolute
        error about 1e-7."""
        e = tl.math.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))  # exp(-2|x|), in (0, 1]: no overflow
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _norm_scale(xhat, w, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        """Llama/Qwen: ``w * round(xhat)``; Gemma (UNIT_OFFSET): ``(1 + w) * xhat`` in float32."""
        if UNIT_OFFSET:
            return xhat * (1.0 + w)
        return w * xhat.to(dtype).to(tl.float32)

    @triton.jit
    def _norm_row(x, w_ptr, b_ptr, offs, mask, H, eps, dtype: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                  LAYER_NORM: tl.constexpr):
        """The norm of one float32 row ``x`` (0 where masked), before its one rounding. RMSNorm:
        ``_norm_scale``; LayerNorm (GPT-2, GPT-NeoX): ``(x - mean) / sqrt(var + eps) * w + b`` in
        float32 with the biased variance, as torch's kernel computes it."""
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if LAYER_NORM:
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            centred = tl.where(mask, x - tl.sum(x, axis=0) / H, 0.0)
            return centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / H + eps) * w + b
        return _norm_scale(x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps), w, dtype, UNIT_OFFSET)

    @triton.jit
    def _norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, stride_x, stride_y, H, eps, BLOCK: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, LAYER_NORM: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dtype = y_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = _norm_row(x, w_ptr, b_ptr, offs, mask, H, eps, dtype, UNIT_OFFSET, LAYER_NORM)
        tl.store(y_ptr + row * stride_y + offs, y.to(dtype), mask=mask)

    @triton.jit
    def _add_row(row, index_ptr, add_ptr, stride_add, offs, mask, ADD: tl.constexpr):
        """The row's additive steering vector (float32), or 0. Kernels load it before their own
        inputs: at batch 1 they are latency-bound, and this load waits on the index load first."""
        add = 0.0
        if ADD:
            r = tl.load(index_ptr + row)
            add = tl.load(add_ptr + r * stride_add + offs, mask=mask, other=0.0).to(tl.float32)
        return add

    @triton.jit
    def _steer_site(x, add, row, index_ptr, dir_ptr, bounds_ptr, write_ptr, gate_ptr, stride_dir_row,
                    stride_dir_slot, offs, mask, dtype: tl.constexpr, ADD: tl.constexpr, CLAMPS: tl.constexpr,
                    SPLIT: tl.constexpr):
        """The steering writes of one hook point on one row of float32 ``x`` (holding values of the
        activation dtype): add the row's table vector ``add``, then each projection clamp slot
        ``x += strength * (clip(factor * x.d, lo, hi) - x.d) * d`` in float32, rounding where the
        separate ops round. With SPLIT (a feature clamp at the site) a slot reads ``a = p if p >
        threshold else 0`` for ``p = x.d + bias`` and writes along its own direction ``w``:
        ``x += strength * (clip(factor * a, lo, hi) - a) * w``. Standalone and fused kernels share
        it, so they agree bit for bit."""
        if ADD:
            x = (x + add).to(dtype).to(tl.float32)
        if CLAMPS > 0:
            r = tl.load(index_ptr + row)
            for k in tl.static_range(CLAMPS):
                d = tl.load(dir_ptr + r * stride_dir_row + k * stride_dir_slot + offs, mask=mask,
                            other=0.0).to(tl.float32)
                lo = tl.load(bounds_ptr + (r * CLAMPS + k) * 4)
                hi = tl.load(bounds_ptr + (r * CLAMPS + k) * 4 + 1)
                strength = tl.load(bounds_ptr + (r * CLAMPS + k) * 4 + 2)
                factor = tl.load(bounds_ptr + (r * CLAMPS + k) * 4 + 3)
                p = tl.sum(x * d, axis=0)
                w = d
                if SPLIT:
                    w = tl.load(write_ptr + r * stride_dir_row + k * stride_dir_slot + offs, mask=mask,
                                other=0.0).to(tl.float32)
                    p = p + tl.load(gate_ptr + (r * CLAMPS + k) * 2)
                    p = tl.where(p > tl.load(gate_ptr + (r * CLAMPS + k) * 2 + 1), p, 0.0)
                x = x + (strength * (tl.minimum(tl.maximum(factor * p, lo), hi) - p)) * w
            x = x.to(dtype).to(tl.float32)
        return x

    @triton.jit
    def _steer_kernel(x_ptr, out_ptr, stride_x, stride_out, H,
                      index_ptr, add_ptr, stride_add, dir_ptr, bounds_ptr, write_ptr, gate_ptr, stride_dir_row,
                      stride_dir_slot, ADD: tl.constexpr, CLAMPS: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dtype = out_ptr.dtype.element_ty
        add = _add_row(row, index_ptr, add_ptr, stride_add, offs, mask, ADD)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = _steer_site(x, add, row, index_ptr, dir_ptr, bounds_ptr, write_ptr, gate_ptr, stride_dir_row,
                        stride_dir_slot, offs, mask, dtype, ADD, CLAMPS, SPLIT)
        tl.store(out_ptr + row * stride_out + offs, x.to(dtype), mask=mask)

    @triton.jit
    def _add_norm_kernel(res_ptr, delta_ptr, w_ptr, bias_ptr, out_ptr, y_ptr, stride_res, stride_delta, stride_out,
                         stride_y, H, eps, pre_w_ptr, pre_eps,
                         i1_ptr, a1_ptr, stride_a1, d1_ptr, b1_ptr, w1_ptr, g1_ptr, stride_d1r, stride_d1k,
                         i2_ptr, a2_ptr, stride_a2, d2_ptr, b2_ptr, w2_ptr, g2_ptr, stride_d2r, stride_d2k,
                         HAS_DELTA: tl.constexpr, ADD1: tl.constexpr, CLAMPS1: tl.constexpr, SPLIT1: tl.constexpr,
                         ADD2: tl.constexpr, CLAMPS2: tl.constexpr, SPLIT2: tl.constexpr, BLOCK: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, LAYER_NORM: tl.constexpr, PRE_NORM: tl.constexpr,
                         PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        dtype = out_ptr.dtype.element_ty
        add1 = _add_row(row, i1_ptr, a1_ptr, stride_a1, offs, mask, ADD1)
        add2 = _add_row(row, i2_ptr, a2_ptr, stride_a2, offs, mask, ADD2)
        x = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
            if PRE_NORM:  # the branch's own RMSNorm first (Gemma's post-attention norm), rounded as _norm_kernel rounds
                d = _norm_row(d, pre_w_ptr, pre_w_ptr, offs, mask, H, pre_eps, dtype, UNIT_OFFSET, False)
                d = d.to(dtype).to(tl.float32)
            x = (x + d).to(dtype).to(tl.float32)
        x = _steer_site(x, add1, row, i1_ptr, d1_ptr, b1_ptr, w1_ptr, g1_ptr, stride_d1r, stride_d1k, offs, mask,
                        dtype, ADD1, CLAMPS1, SPLIT1)
        x = _steer_site(x, add2, row, i2_ptr, d2_ptr, b2_ptr, w2_ptr, g2_ptr, stride_d2r, stride_d2k, offs, mask,
                        dtype, ADD2, CLAMPS2, SPLIT2)
        tl.store(out_ptr + row * stride_out + offs, x.to(dtype), mask=mask)
        y = _norm_row(x, w_ptr, bias_ptr, offs, mask, H, eps, dtype, UNIT_OFFSET, LAYER_NORM)
        tl.store(y_ptr + row * stride_y + offs, y.to(dtype), mask=mask)

    @triton.jit
    def gated_act(gate, up, dtype: tl.constexpr, GELU_TANH: tl.constexpr):
        """``act(gate) * up`` from float32 inputs, rounded to ``dtype`` where the PyTorch ops round;
        the gated kernel and the GEMV that fuses it share it, so they agree bit for bit."""
        if GELU_TANH:
            # 0.5 x (1 + tanh(z)) == x * sigmoid(2 z), z = sqrt(2 / pi) (x + 0.044715 x^3): no tanh needed
            # (1.5957... = 2 sqrt(2 / pi)).
            act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
        else:
            act = gate * tl.sigmoid(gate)
        return (act.to(dtype).to(tl.float32) * up).to(dtype)

    @triton.jit
    def _gated_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
        """act(gate) * up with act SiLU (SwiGLU) or the tanh GELU (GeGLU)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, gated_act(gate, up, y_ptr.dtype.element_ty, GELU_TANH), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                             kc_ptr, vc_ptr, slot_ptr, stride_qkv, stride_q, stride_k, stride_cos, eps,
                             stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, stride_vcd,
                             k_scale, v_scale,
                             NUM_Q: tl.constexpr, NUM_QK: tl.constexpr, HEADS_PAD: tl.constexpr,
                             HEAD_D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
                             STORE_KV: tl.constexpr, KV_PAD: tl.constexpr, D_PAD: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                             PDL: tl.constexpr):
        # One program per token: every q and k head of it as a [heads, head_dim / 2] pair of tiles.
        pdl_enter(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS_PAD)[:, None]
        offs = tl.arange(0, HALF)[None, :]
        col_mask = offs < HEAD_D // 2
        mask = (head < NUM_QK) & col_mask
        is_q = head < NUM_Q
        src = qkv_ptr + token * stride_qkv + head * HEAD_D
        x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HEAD_D // 2 + offs, mask=mask, other=0.0).to(tl.float32)
        dtype = q_ptr.dtype.element_ty
        if QK_NORM:
            w1 = tl.where(is_q, tl.load(qw_ptr + offs, mask=col_mask, other=0.0),
                          tl.load(kw_ptr + offs, mask=col_mask, other=0.0)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(qw_ptr + HEAD_D // 2 + offs, mask=col_mask, other=0.0),
                          tl.load(kw_ptr + HEAD_D // 2 + offs, mask=col_mask, other=0.0)).to(tl.float32)
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_D + eps)[:, None]
            x1 = _norm_scale(x1 * inv, w1, dtype, UNIT_OFFSET).to(dtype).to(tl.float32)
            x2 = _norm_scale(x2 * inv, w2, dtype, UNIT_OFFSET).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + token)
        c = tl.load(cos_ptr + pos * stride_cos + offs, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + offs, mask=col_mask, other=0.0).to(dtype).to(tl.float32)
        out1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
        q_dst = q_ptr + token * stride_q + head * HEAD_D
        tl.store(q_dst + offs, out1, mask=mask & is_q)
        tl.store(q_dst + HEAD_D // 2 + offs, out2, mask=mask & is_q)
        if STORE_KV:  # k and v go straight to their paged-cache slot (-1: a padding row, skipped)
            slot = tl.load(slot_ptr + token)
            if slot >= 0:
                block = slot // BLOCK_SIZE
                offset = slot % BLOCK_SIZE
                k_dst = kc_ptr + block * stride_kcb + offset * stride_kco + (head - NUM_Q) * stride_kch
                k1, k2 = out1, out2
                if KV_FP8:  # a float8 cache holds value / scale, saturated at 448
                    k1 = to_fp8(out1, k_scale, kc_ptr.dtype.element_ty)
                    k2 = to_fp8(out2, k_scale, kc_ptr.dtype.element_ty)
                tl.store(k_dst + offs, k1, mask=mask & ~is_q)
                tl.store(k_dst + HEAD_D // 2 + offs, k2, mask=mask & ~is_q)
                kv_head = tl.arange(0, KV_PAD)[:, None]
                dim = tl.arange(0, D_PAD)[None, :]
                v_mask = (kv_head < NUM_QK - NUM_Q) & (dim < HEAD_D)
                v = tl.load(qkv_ptr + token * stride_qkv + (NUM_QK + kv_head) * HEAD_D + dim, mask=v_mask)
                if KV_FP8:
                    v = to_fp8(v, v_scale, vc_ptr.dtype.element_ty)
                tl.store(vc_ptr + block * stride_vcb + offset * stride_vco + kv_head * stride_vch + dim * stride_vcd, v,
                         mask=v_mask)
        else:
            k_dst = k_ptr + token * stride_k + (head - NUM_Q) * HEAD_D
            tl.store(k_dst + offs, out1, mask=mask & ~is_q)
            tl.store(k_dst + HEAD_D // 2 + offs, out2, mask=mask & ~is_q)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of a [N, H] (or [..., H]) tensor; ``unit_offset``: Gemma's (1 + w)."""
    return _norm(x, weight, None, eps, unit_offset)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (with bias) over the last dim of a [N, H] (or [..., H]) tensor."""
    return _norm(x, weight, bias, eps, False)


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
          unit_offset: bool) -> torch.Tensor:
    """RMSNorm, or LayerNorm where there is a ``bias``, one program per row."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _norm_kernel[(x2.shape[0],)](x2, weight, bias if bias is not None else weight, y, x2.stride(0), y.stride(0),
                                     shape[-1], eps, BLOCK=triton.next_power_of_2(shape[-1]), UNIT_OFFSET=unit_offset,
                                     LAYER_NORM=bias is not None, num_warps=_num_warps(shape[-1]), **pdl_args(x2))
    return y.view(shape)


def _site_args(write: SiteWrite | None, like: torch.Tensor) -> tuple[list, bool, int, bool]:
    """Kernel arguments of one site's writes (placeholders where it has none), ADD, CLAMPS, SPLIT."""
    if write is None:
        return [like, like, 0, like, like, like, like, 0, 0], False, 0, False
    add, directions, bounds = write.add, write.clamp_dir, write.clamp_bounds
    clamps = directions.shape[1] if directions is not None else 0
    if bounds is not None and not bounds.is_contiguous():
        raise ValueError("clamp bounds must be contiguous [rows, slots, 4]")
    split = clamps > 0 and write.clamp_write is not None
    if split and (write.clamp_write.stride() != directions.stride() or not write.clamp_gate.is_contiguous()):
        raise ValueError("clamp write directions must be laid out as the read ones, gates contiguous [rows, slots, 2]")
    return ([write.index, add if add is not None else like, add.stride(0) if add is not None else 0,
             directions if clamps else like, bounds if clamps else like,
             write.clamp_write if split else like, write.clamp_gate if split else like,
             directions.stride(0) if clamps else 0, directions.stride(1) if clamps else 0],
            add is not None, clamps, split)


def _num_warps(width: int) -> int:
    return 4 if width <= 4096 else 8


def steer(hidden: torch.Tensor, write: SiteWrite) -> torch.Tensor:
    """``hidden`` [N, H] with one site's writes applied (additive row, then clamp slots), in one
    kernel: the unfused path, bit for bit what ``add_rms_norm`` computes for its residual."""
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    n, width = hidden.shape
    out = torch.empty_like(hidden)
    if n:
        args, add, clamps, split = _site_args(write, hidden)
        _steer_kernel[(n,)](hidden, out, hidden.stride(0), out.stride(0), width, *args, ADD=add, CLAMPS=clamps,
                            SPLIT=split, BLOCK=triton.next_power_of_2(width), num_warps=_num_warps(width))
    return out


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
                 weight: torch.Tensor, eps: float, unit_offset: bool = False,
                 delta_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + delta``, then the steering writes of up to two hook points in order (each an
    additive table row and projection clamps, rounded to the activation dtype as the separate ops
    round), and ``rms_norm(h)``, in one kernel: the residual add and steering cost no pass of their
    own. residual/delta: [N, H]; each write's index covers at least N rows. ``delta_norm`` (weight,
    eps): ``delta`` is first ``rms_norm``-ed with them (the same ``unit_offset``), bit for bit what
    ``rms_norm`` returns, so a branch's post-norm (Gemma's) costs no kernel of its own."""
    return _add_norm(residual, delta, writes, weight, None, eps, unit_offset, delta_norm)


def add_layer_norm(residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
                   weight: torch.Tensor, bias: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm`` with a LayerNorm (GPT-2, GPT-NeoX) at the end."""
    return _add_norm(residual, delta, writes, weight, bias, eps, False)


def _add_norm(residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
              weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
              unit_offset: bool, delta_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if delta_norm is not None and (delta is None or bias is not None):
        raise ValueError("delta_norm normalises a delta before an RMSNorm: it needs a delta and no bias")
    if len(writes) > 2:
        raise ValueError(f"add_rms_norm takes the writes of at most two hook points, got {len(writes)}")
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    n, width = residual.shape
    out = torch.empty_like(residual)
    y = torch.empty_like(residual)
    if n:
        (args1, add1, clamps1, split1), (args2, add2, clamps2, split2) = [
            _site_args(w, residual) for w in [*writes, *[None] * (2 - len(writes))]]
        _add_norm_kernel[(n,)](
            residual, delta if delta is not None else residual, weight, bias if bias is not None else weight, out, y,
            residual.stride(0), delta.stride(0) if delta is not None else 0, out.stride(0), y.stride(0), width, eps,
            delta_norm[0] if delta_norm is not None else weight, float(delta_norm[1]) if delta_norm is not None else 0.0,
            *args1, *args2, HAS_DELTA=delta is not None, ADD1=add1, CLAMPS1=clamps1, SPLIT1=split1, ADD2=add2,
            CLAMPS2=clamps2, SPLIT2=split2,
            BLOCK=triton.next_power_of_2(width), UNIT_OFFSET=unit_offset, LAYER_NORM=bias is not None,
            PRE_NORM=delta_norm is not None, num_warps=_num_warps(width), **pdl_args(residual))
    return out, y


def _gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """[N, 2I] (gate | up) -> act(gate) * up, [N, I]."""
    n, width = x.shape
    inter = width // 2
    y = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _gated_mul_kernel[(n, triton.cdiv(inter, block))](x, y, x.stride(0), y.stride(0), inter, BLOCK=block,
                                                          GELU_TANH=gelu_tanh, num_warps=4)
    return y


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: [N, 2I] (gate | up) -> [N, I]."""
    return _gated(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with tanh-approximated GELU (Gemma): [N, 2I] (gate | up) -> [N, I]."""
    return _gated(x, gelu_tanh=True)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float,
                 kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None = None,
                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split a fused qkv projection [T, (Hq + 2 Hkv) D] into q, k (optionally RMS-normed per head,
    then rotated) and a view of v, in one kernel for q and k. Given ``kv_cache = (k_cache,
    v_cache, slot_mapping, k_scale, v_scale)`` (caches [blocks, block_size, Hkv, D], V of any
    strides (a float8 cache keeps it position-major); a float8
    cache stores value / scale) the same kernel writes k and v into their cache slots instead and
    returns ``(q, None, None)``: no separate KV-store pass. ``unit_offset``: the q/k norms scale by
    Gemma's (1 + w)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    store = kv_cache is not None
    if store:
        k = v = None
        k_cache, v_cache, slots, k_scale, v_scale = kv_cache
        cache_strides = (*k_cache.stride()[:3], *v_cache.stride())
    else:
        k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
        k_cache, v_cache, slots, cache_strides = q, q, positions, (0,) * 7  # unread without the store
        k_scale = v_scale = 1.0
    if tokens:
        norm = q_weight is not None
        _qk_norm_rope_kernel[(tokens,)](
            qkv, q, q if store else k, positions, cos, sin, q_weight if norm else qkv, k_weight if norm else qkv,
            k_cache, v_cache, slots, qkv.stride(0), q.stride(0), 0 if store else k.stride(0), cos.stride(0), eps,
            *cache_strides, float(k_scale), float(v_scale),
            NUM_Q=num_heads, NUM_QK=num_heads + num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
            HEAD_D=head_dim, HALF=triton.next_power_of_2(head_dim // 2), QK_NORM=norm, STORE_KV=store,
            KV_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1] if store else 1,
            KV_FP8=store and k_cache.dtype == torch.float8_e4m3fn, UNIT_OFFSET=unit_offset,
            num_warps=4, **pdl_args(qkv))
    return q, k, v
