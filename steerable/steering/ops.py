"""The steering data plane: fixed-shape table lookups, so a CUDA graph can replay them with new
indices and new table contents."""

from __future__ import annotations

import torch


def add_rows(hidden: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``h + table[index]``; row 0 of the table is zeros, so unsteered rows are unchanged bit for bit."""
    return hidden + table.index_select(0, index)


def clamp_rows(hidden: torch.Tensor, direction: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
               strength: torch.Tensor, index: torch.Tensor, write: torch.Tensor | None = None,
               gate: torch.Tensor | None = None, factor: torch.Tensor | None = None) -> torch.Tensor:
    """For each clamp slot k: ``p = h·d; h += strength * (clip(factor * p, lo, hi) - p) * d`` (float32
    math; ``factor`` [R, K], None: 1, and 1 leaves ``p`` exactly as read).

    With ``write`` [R, K, H] and ``gate`` [R, K, 2] (bias, threshold; feature clamps) the slot reads
    ``p = h·d + bias``, gated to ``a = p if p > threshold else 0``, and writes along ``write``:
    ``h += strength * (clip(factor * a, lo, hi) - a) * w``.
    Rows without a clamp in a slot have ``strength = 0`` and ``d = 0``, which adds exact zeros.
    direction: [R, K, H]; lo/hi/strength: [R, K] float32.
    """
    out = hidden.float()
    for k in range(direction.shape[1]):
        d = direction[:, k].index_select(0, index).float()
        p = (out * d).sum(-1)
        w = d
        if write is not None:
            w = write[:, k].index_select(0, index).float()
            p = p + gate[:, k, 0].index_select(0, index)
            p = torch.where(p > gate[:, k, 1].index_select(0, index), p, torch.zeros_like(p))
        scaled = p if factor is None else factor[:, k].index_select(0, index) * p
        target = torch.minimum(torch.maximum(scaled, lo[:, k].index_select(0, index)), hi[:, k].index_select(0, index))
        out = out + (strength[:, k].index_select(0, index) * (target - p)).unsqueeze(-1) * w
    return out.to(hidden.dtype)
