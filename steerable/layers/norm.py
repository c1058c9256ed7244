"""Norms with the same float32 arithmetic as Hugging Face's implementations. RMSNorm: Llama/Qwen scale
the downcast normalised value by ``weight``; Gemma scales by ``1 + weight`` in float32, then
downcasts. LayerNorm (GPT-2, GPT-NeoX): ``torch.nn.LayerNorm``'s, mean and variance in float32 and
``weight``, ``bias`` applied before the one rounding."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from steerable.hook_points import SiteWrite
from steerable.layers import cpu_kernels, fused


class RMSNorm(nn.Module):
    unit_offset = False  # the fused kernels' switch for Gemma's (1 + weight)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dim() == 2 and cpu_kernels.applies(x, self.weight) and x.stride(-1) == 1:
            return cpu_kernels.kernels().rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fused_add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
                       delta_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(residual + delta with each site's steering writes applied, its norm)`` in one kernel
        where this norm has one for this device, with the rounding of the separate ops; None
        otherwise. ``delta_norm``: ``delta`` passes that norm first (an RMSNorm of this kind). On a
        CPU with its kernels, the plain add and norm (no writes) are one kernel."""
        if not fused.enabled(residual):
            if (delta is None or writes or delta_norm is not None or self.unit_offset or residual.dim() != 2
                    or not cpu_kernels.applies(residual, delta, self.weight)
                    or residual.stride(-1) != 1 or delta.stride(-1) != 1):
                return None
            return tuple(cpu_kernels.kernels().add_rms_norm(residual, delta, self.weight, self.eps))
        pre = None
        if delta_norm is not None:
            if type(delta_norm) is not type(self) or delta is None:
                return None
            pre = (delta_norm.weight, delta_norm.eps)
        return fused.add_rms_norm(residual, delta, writes, self.weight, self.eps, unit_offset=self.unit_offset,
                                  delta_norm=pre)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: ``(x / rms(x)) * (1 + weight)`` all in float32, rounded once at the end. The
    weight is stored as HF stores it (zero-centred), so checkpoints load unchanged."""

    unit_offset = True

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps, unit_offset=True)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PassThrough(nn.Module):
    """The norm of a hook point that no norm follows (OLMo-2 reads the raw residual stream):
    ``residual_norm`` with it returns the stream twice; steering there runs unfused."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def fused_add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
                       delta_norm: nn.Module | None = None) -> None:
        return None


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with a bias, and the same fused residual + steering + norm kernel as RMSNorm."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):
            return fused.layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def fused_add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, writes: Sequence[SiteWrite],
                       delta_norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As ``RMSNorm.fused_add_norm``, with a LayerNorm at the end (and no ``delta_norm``)."""
        if not fused.enabled(residual) or delta_norm is not None:
            return None
        return fused.add_layer_norm(residual, delta, writes, self.weight, self.bias, self.eps)
