"""The named points where the forward pass hands activations to the steering and capture planes.

Model files only call ``hooks.residual(...)`` / ``hooks.observe(...)``; what happens there is
decided per step by the planes attached to the ``HookPoints`` object and the ``StepBatch``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

PRE_ATTN = "pre_attn"  # residual stream entering layer L (HF hidden_states[L])
POST_ATTN = "post_attn"  # residual after the attention residual add
POST_MLP = "post_mlp"  # layer output (HF hidden_states[L + 1], before any final norm)
RESIDUAL_POINTS = (PRE_ATTN, POST_ATTN, POST_MLP)
ATTENTION_HEADS = "attention_heads"  # per-head attention output before o_proj, concatenated
ROUTER_LOGITS = "router_logits"  # MoE gate logits before top-k


class Writer(Protocol):
    def apply(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor: ...


class Reader(Protocol):
    def record(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> None: ...


class HookPoints:
    """Dispatches each hook point to the attached planes: writers first (steering), then readers
    (capture), so captured activations are the steered ones."""

    def __init__(self) -> None:
        self.writers: list[Writer] = []
        self.readers: list[Reader] = []

    def residual(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        for writer in self.writers:
            hidden = writer.apply(point, layer, hidden, batch)
        for reader in self.readers:
            reader.record(point, layer, hidden, batch)
        return hidden

    def observe(self, component: str, layer: int, value: torch.Tensor, batch: Any) -> None:
        for reader in self.readers:
            reader.record(component, layer, value, batch)
