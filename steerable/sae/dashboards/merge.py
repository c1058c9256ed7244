"""Exact merges of example lists: top-k by activation and seeded reservoirs by key.

A feature's examples sit in a pool of places (``Places``, ``[features, places]`` columns) in no
particular order: a place keeps its example until a better one takes it, so the examples' windows,
kept elsewhere by place (on the host), are written once, when an example arrives, and never moved.
Merging is one rule applied to the union of what a feature holds and what arrives: group the
examples (the top list is one group; reservoirs group by quantile bin), order each group, keep the
first ``cap`` of each. The top list orders by activation (highest first), then corpus index, then
position; a quantile bin by ``sample_keys`` (smallest first), then corpus index, then position.
Both are total orders on distinct (corpus index, position) pairs, so what is kept is a function of
the union alone: any batching, chunking or sharding of the corpus keeps the same examples.

Everything here is plain tensor code, run on the device during a pass and on the host to merge
shards, and only over the rows (features) an update touches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from steerable.sae.dashboards.grid import bin_index

KEY_EMPTY = 2**40  # above every 32-bit key: an empty place, and a quantile bin not yet full


@dataclass
class Places:
    """Per row (feature) a pool of places: the activation ``value``, the text's corpus index
    ``example`` (-1: empty place), the ``position`` in it and the sample ``key``; ``source`` says
    where an arriving example's window is (an index into its sender's window table)."""

    value: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    key: torch.Tensor
    source: torch.Tensor

    @staticmethod
    def empty(rows: int, places: int, device: torch.device | str = "cpu") -> "Places":
        shape = (rows, places)
        return Places(torch.zeros(shape, dtype=torch.float32, device=device),
                      torch.full(shape, -1, dtype=torch.long, device=device),
                      torch.zeros(shape, dtype=torch.long, device=device),
                      torch.full(shape, KEY_EMPTY, dtype=torch.long, device=device),
                      torch.full(shape, -1, dtype=torch.long, device=device))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.value.shape)

    def columns(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def rows(self, index: torch.Tensor) -> "Places":
        return Places(*(c[index] for c in self.columns()))

    def set_rows(self, index: torch.Tensor, other: "Places") -> None:
        for mine, theirs in zip(self.columns(), other.columns()):
            mine[index] = theirs

    def to(self, device: torch.device | str) -> "Places":
        return Places(*(c.to(device) for c in self.columns()))

    def held(self) -> torch.Tensor:
        return self.example >= 0

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{f.name}": getattr(self, f.name) for f in fields(self) if f.name != "source"}

    @staticmethod
    def from_state_dict(tensors: dict[str, torch.Tensor], prefix: str) -> "Places":
        value = tensors[f"{prefix}.value"]
        return Places(value, tensors[f"{prefix}.example"], tensors[f"{prefix}.position"], tensors[f"{prefix}.key"],
                      torch.full_like(value, -1, dtype=torch.long))


# Orders as few int64 sort keys as possible (each key is one stable sort): a group-major primary key
# (the group in the high bits) and the corpus order ``example << 24 | position`` (positions stay
# below 2**24, corpus indices below 2**39).
POSITION_BITS = 24
_EMPTY = 2**62  # an empty place's primary key: after every example


def corpus_order(example: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return (example << POSITION_BITS) | position


def descending(value: torch.Tensor) -> torch.Tensor:
    """An int64 that sorts activations (float32, >= 0) from the highest: their bits are monotone."""
    return (2**31 - 1) - value.contiguous().view(torch.int32).long()


# How a list groups and orders its examples: ``order(pool, rows) -> (group, primary key)``.
Order = Callable[[Places, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def top_order(pool: Places, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros_like(pool.example), descending(pool.value)


def reservoir_order(exponent: torch.Tensor) -> Order:
    """Quantile bins on the grid ``exponent[feature]``, each ordered by key."""
    def order(pool: Places, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        group = bin_index(pool.value, exponent[rows].unsqueeze(1).expand_as(pool.example))
        return group, (group << 32) | pool.key
    return order


def ranks(group: torch.Tensor, primary: torch.Tensor, corpus: torch.Tensor) -> torch.Tensor:
    """Per row, each entry's rank within its ``group`` ordered by ``primary`` then ``corpus``
    (``primary`` sorts group-major): two stable sorts, least significant first."""
    rows, n = group.shape
    order = torch.sort(corpus, dim=1, stable=True).indices
    order = order.gather(1, torch.sort(primary.gather(1, order), dim=1, stable=True).indices)
    sorted_group = group.gather(1, order)
    index = torch.arange(n, device=group.device).expand(rows, n)
    starts = torch.ones_like(sorted_group, dtype=torch.bool)
    starts[:, 1:] = sorted_group[:, 1:] != sorted_group[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return torch.empty_like(order).scatter_(1, order, index - first)


def _nth_true(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the column of its j-th True at ``[row, j]`` (one spare column at the end)."""
    rows, n = mask.shape
    slot = torch.where(mask, mask.long().cumsum(1) - 1, n)
    return torch.full((rows, n + 1), n, dtype=torch.long, device=mask.device).scatter_(
        1, slot, torch.arange(n, device=mask.device).expand(rows, n).clone())


def merge_rows(held: Places, arriving: Places, rows: torch.Tensor, order: Order, cap: int
               ) -> tuple[Places, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``arriving`` (``[len(rows), m]``) into the places of ``rows`` of ``held``, keeping
    ``cap`` examples per group. Kept examples stay where they are; arriving ones take freed
    places. Returns the rows' new places and, per example placed, its row (index into ``rows``),
    its place and its ``source``."""
    mine = held.rows(rows)
    places = mine.shape[1]
    pool = Places(*(torch.cat([a, b], 1) for a, b in zip(mine.columns(), arriving.columns())))
    present = pool.held()
    group, primary = order(pool, rows)
    rank = ranks(torch.where(present, group, _EMPTY), torch.where(present, primary, _EMPTY),
                 corpus_order(pool.example.clamp_min(0), pool.position))
    kept = present & (rank < cap)
    stay, new = kept[:, :places], kept[:, places:]
    count = new.sum(1, keepdim=True)  # never more than the places freed
    row, j = (torch.arange(new.shape[1], device=new.device) < count).nonzero(as_tuple=True)
    place, src = _nth_true(~stay)[row, j], _nth_true(new)[row, j]
    out = Places(*(torch.where(stay, c, e) for c, e in zip(mine.columns(), Places.empty(*mine.shape, new.device)
                                                            .columns())))
    for column, column_in in zip(out.columns(), arriving.columns()):
        column[row, place] = column_in[row, src]
    return out, row, place, arriving.source[row, src]


def pack(feature: torch.Tensor, group: torch.Tensor, primary: torch.Tensor, cap: int, groups: int,
         columns: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Places]:
    """Flat examples (``feature``, ``group`` per example, ``columns`` = value, example, position,
    key, source) as ``[len(rows), groups * cap]`` arriving places of ``rows`` (the features
    present), at most ``cap`` per group, the first by ``primary`` (below 2**32 within a group)
    then corpus order: what a merge would keep of them."""
    corpus = corpus_order(columns[1], columns[2])
    rows, row = torch.unique(feature, return_inverse=True)
    flat = row * groups + group
    rank = ranks(flat.unsqueeze(0), ((flat << 32) | primary).unsqueeze(0), corpus.unsqueeze(0))[0]
    keep = (rank < cap).nonzero().squeeze(1)
    arriving = Places.empty(len(rows), groups * cap, feature.device)
    at = (row[keep], group[keep] * cap + rank[keep])
    for column, values in zip(arriving.columns(), columns):
        column[at] = values[keep]
    return rows, arriving
