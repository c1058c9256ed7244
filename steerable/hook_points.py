"""The named points where the forward pass hands activations to the steering and capture planes.

Model files only call ``hooks.residual_norm(...)`` / ``hooks.observe(...)``; what happens there is
decided per step by the planes attached to the ``HookPoints`` object and the ``StepBatch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from steerable.layers import fused

PRE_ATTN = "pre_attn"  # residual stream entering layer L (HF hidden_states[L])
POST_ATTN = "post_attn"  # residual after the attention residual add
POST_MLP = "post_mlp"  # layer output (HF hidden_states[L + 1], before any final norm)
RESIDUAL_POINTS = (PRE_ATTN, POST_ATTN, POST_MLP)
ATTENTION_HEADS = "attention_heads"  # per-head attention output before o_proj, concatenated
ROUTER_LOGITS = "router_logits"  # MoE gate logits before top-k

Site = tuple[str, int]


class Writer(Protocol):
    def apply(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor: ...

    def acts_at(self, point: str, layer: int, batch: Any) -> bool:
        """Whether ``apply`` may change anything at this site in this step."""

    def table_add(self, point: str, layer: int, batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(table, index)`` when the effect here is exactly ``h + table[index]``, else None."""


class Reader(Protocol):
    def record(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> None: ...

    def wants(self, point: str, layer: int, batch: Any) -> bool:
        """Whether ``record`` reads anything at this site in this step."""


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

    def residual_norm(self, sites: Sequence[Site], residual: torch.Tensor, delta: torch.Tensor | None,
                      norm: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream ``residual + delta`` passes the hook points ``sites`` in order and is
        then normalised by ``norm`` (an RMSNorm): returns (the residual, its norm).

        On the GPU, when every writer's effect is a table lookup to add and no reader needs a value
        that a later write changes, this is one kernel (add, steer, norm); otherwise each point is
        applied in turn. Both give the same values."""
        adds = self._table_adds(sites, batch) if fused.enabled(residual) else None
        if adds is not None:
            hidden, normed = fused.add_rms_norm(residual, delta, adds, norm.weight, norm.eps)
            for point, layer in sites:
                for reader in self.readers:
                    reader.record(point, layer, hidden, batch)
            return hidden, normed
        hidden = residual if delta is None else residual + delta
        for point, layer in sites:
            hidden = self.residual(point, layer, hidden, batch)
        return hidden, norm(hidden)

    def observe(self, component: str, layer: int, value: torch.Tensor, batch: Any) -> None:
        for reader in self.readers:
            reader.record(component, layer, value, batch)

    def _table_adds(self, sites: Sequence[Site], batch: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The writers' effect at ``sites`` as at most two table lookups, or None when it is not
        expressible so (a non-additive write, a read between two writes, more than two tables)."""
        adds = []
        read = False
        for point, layer in sites:
            for writer in self.writers:
                if not writer.acts_at(point, layer, batch):
                    continue
                add = writer.table_add(point, layer, batch)
                if add is None or read:
                    return None
                adds.append(add)
            read = read or any(reader.wants(point, layer, batch) for reader in self.readers)
        return adds if len(adds) <= 2 else None
