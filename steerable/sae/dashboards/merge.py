"""Exact merges of example lists: top-k by activation and seeded reservoirs by key.

Examples travel as ``Items`` (flat columns) and rest in ``Slots`` (per feature, per group, a fixed
number of places, best first). Merging is one rule applied to the union of what a feature holds
and what arrives: sort by group, then by the group's order, and keep the first ``k`` of each
group. The top list orders by activation (highest first), then corpus index, then position; a
quantile bin orders by ``sample_keys`` (smallest first), then corpus index, then position. Both
are total orders on distinct (corpus index, position) pairs, so the kept set is a function of the
union alone: any batching, chunking or sharding of the corpus keeps the same examples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from steerable.sae.dashboards.grid import bin_index

KEY_EMPTY = 2**40  # above every 32-bit key: an empty reservoir place, and a bin not yet full


@dataclass
class Items:
    """Examples of several features: ``feature`` (index into the run's features), its activation
    ``value`` at ``position`` of text ``example`` (corpus index), the sample ``key``, and the window
    around it: ``acts`` (the feature's activation per token, NaN outside the text) and ``tokens``
    (-1 outside), ``[n, window]``."""

    feature: torch.Tensor
    value: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    key: torch.Tensor
    acts: torch.Tensor
    tokens: torch.Tensor

    def __len__(self) -> int:
        return self.feature.shape[0]

    def take(self, index: torch.Tensor) -> "Items":
        return Items(*(getattr(self, f.name)[index] for f in fields(self)))

    @staticmethod
    def cat(parts: Sequence["Items"]) -> "Items":
        return Items(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Items)))

    def unique(self) -> "Items":
        """Each (feature, corpus index, position) once (an example can be both in a top list and
        in a quantile sample)."""
        order, _ = ranked(self.feature, [self.example, self.position])
        columns = torch.stack([self.feature[order], self.example[order], self.position[order]])
        first = torch.ones(len(self), dtype=torch.bool)
        first[1:] = (columns[:, 1:] != columns[:, :-1]).any(0)
        return self.take(order[first])


class Slots:
    """Per feature ``groups`` lists of at most ``size`` examples, best first; an empty place has
    ``example == -1`` (and ``key == KEY_EMPTY``)."""

    def __init__(self, features: int, groups: int, size: int, window: int):
        shape = (features, groups, size)
        self.value = torch.zeros(shape, dtype=torch.float32)
        self.example = torch.full(shape, -1, dtype=torch.long)
        self.position = torch.zeros(shape, dtype=torch.long)
        self.key = torch.full(shape, KEY_EMPTY, dtype=torch.long)
        self.acts = torch.full((*shape, window), float("nan"), dtype=torch.float32)
        self.tokens = torch.full((*shape, window), -1, dtype=torch.int32)

    FIELDS = ("value", "example", "position", "key", "acts", "tokens")

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.value.shape)

    def items(self, features: torch.Tensor) -> Items:
        """The examples held for ``features`` (ascending indices), flat."""
        held = self.example[features] >= 0
        feature = features.view(-1, 1, 1).expand_as(held)[held]
        return Items(feature, *(getattr(self, name)[features][held] for name in self.FIELDS))

    def fill(self, features: torch.Tensor, group: torch.Tensor, rank: torch.Tensor, items: Items) -> None:
        """Empty every place of ``features``, then put ``items`` at ``[feature, group, rank]``."""
        for name in self.FIELDS:
            tensor = getattr(self, name)
            tensor[features] = -1 if name in ("example", "tokens") else (
                KEY_EMPTY if name == "key" else (float("nan") if name == "acts" else 0))
            tensor[items.feature, group, rank] = getattr(items, name)

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{name}": getattr(self, name) for name in self.FIELDS}

    @staticmethod
    def from_state_dict(tensors: dict[str, torch.Tensor], prefix: str) -> "Slots":
        slots = Slots.__new__(Slots)
        for name in Slots.FIELDS:
            setattr(slots, name, tensors[f"{prefix}.{name}"])
        return slots


def ranked(group: torch.Tensor, keys: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The order sorting by ``group`` then ``keys`` (ascending, most significant first), and each
    sorted item's rank within its group."""
    n = group.shape[0]
    order = torch.arange(n)
    for key in reversed([group, *keys]):  # stable sorts from the least significant key
        order = order[torch.sort(key[order], stable=True).indices]
    sorted_group = group[order]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = sorted_group[1:] != sorted_group[:-1]
    index = torch.arange(n)
    first = torch.cummax(torch.where(starts, index, 0), 0).values
    return order, index - first


def merge_top(slots: Slots, arriving: Items) -> torch.Tensor:
    """Keep per feature the ``size`` highest activations of what it holds and ``arriving``
    (ties: lower corpus index, then lower position); returns the features touched."""
    touched = torch.unique(arriving.feature)
    if len(arriving) == 0:
        return touched
    pool = Items.cat([slots.items(touched), arriving])
    order, rank = ranked(pool.feature, [-pool.value.double(), pool.example, pool.position])
    keep = order[rank < slots.shape[2]]
    slots.fill(touched, torch.zeros_like(keep), rank[rank < slots.shape[2]], pool.take(keep))
    return touched


def merge_reservoir(slots: Slots, arriving: Items, exponent: torch.Tensor, held_exponent: torch.Tensor
                    ) -> torch.Tensor:
    """Keep per feature and quantile bin the ``size`` smallest keys (ties: corpus order) of what it
    holds and ``arriving``, every example binned on the grid ``exponent[feature]``; the examples
    held were binned on ``held_exponent`` (coarser bins hold the union of the finer ones). Returns
    the features touched, which now hold on ``exponent``."""
    regridded = (exponent != held_exponent).nonzero().squeeze(1)
    touched = torch.unique(torch.cat([arriving.feature, regridded]))
    if len(touched) == 0:
        return touched
    pool = Items.cat([slots.items(touched), arriving])
    bins = slots.shape[1]
    group = pool.feature * bins + bin_index(pool.value, exponent[pool.feature])
    order, rank = ranked(group, [pool.key, pool.example, pool.position])
    kept = rank < slots.shape[2]
    keep = order[kept]
    slots.fill(touched, group[keep] % bins, rank[kept], pool.take(keep))
    return touched
