"""Capture planning on the driver: which rows each destination (a stream, or a request's own
``CaptureSpec``) records in a step, grouped into the plain ``CapturePlan`` the worker gathers, and
the ``Delivery`` that later splits the gathered rows back to their destinations with labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.request import Request, ScheduledRequest
from steerable.selection import SelectSpec
from steerable.step import CaptureGroup, CapturePlan


@dataclass
class RowSelector:
    """A destination's row choice for one request, resolved once at admission (prompt part) so the
    per-step work is a range lookup; from ``all_from`` on every row is taken (no mask); other
    generation rows fall back to ``SelectSpec.mask``."""

    select: SelectSpec | None
    prompt_positions: np.ndarray | None  # sorted selected prompt positions; None = every row
    generation: bool  # may select generation rows
    all_from: float  # every row at or after this position is selected

    @classmethod
    def build(cls, select: SelectSpec | None, prompt: list[int]) -> "RowSelector":
        if select is None:
            return cls(None, None, True, 0)
        return cls(select, np.asarray(select.prompt_positions_selected(prompt), dtype=np.int64),
                   select.may_select_generation(), select.selects_all_from(len(prompt)))

    def first_prompt_position(self, at_least: int, prompt_len: int) -> int:
        """Lowest selected prompt position >= at_least (prompt_len if none): cache hits stop there."""
        if self.prompt_positions is None:
            return min(at_least, prompt_len)
        later = self.prompt_positions[self.prompt_positions >= at_least]
        return int(later[0]) if len(later) else prompt_len

    def next_position(self, at_least: int, prompt_len: int) -> float:
        """Lowest position >= at_least this selector might pick (inf when none can follow)."""
        if self.select is None or at_least >= self.all_from:
            return at_least
        return self.select.next_candidate(at_least, prompt_len)

    def rows(self, positions: np.ndarray, token_ids: np.ndarray, prompt_len: int, skip_below: int) -> np.ndarray:
        """Indices into this chunk of the rows to record (positions are consecutive)."""
        start, n = int(positions[0]), len(positions)
        lo = max(start, skip_below)
        if lo >= self.all_from:
            return np.arange(lo - start, n) if lo < start + n else _NO_ROWS
        pp = self.prompt_positions
        prompt_rows = pp[(pp >= lo) & (pp < min(start + n, prompt_len))] - start
        if not self.generation or start + n <= prompt_len:
            return prompt_rows
        g0 = max(lo, prompt_len) - start
        if g0 >= n:
            return prompt_rows
        if g0 + start >= self.all_from:
            return np.concatenate([prompt_rows, np.arange(g0, n)])
        mask = self.select.mask(torch.from_numpy(positions[g0:]), prompt_len, torch.from_numpy(token_ids[g0:]))
        return np.concatenate([prompt_rows, np.flatnonzero(mask.numpy()) + g0])


_NO_ROWS = np.empty(0, np.int64)


@dataclass
class Destination:
    """A stream or one request's spec: what to read and where it goes."""

    key: tuple  # ("stream", name, serial) or ("request", request_id, stream), + the SAE name for sae_features
    component: str
    hook: str  # hook point name read (residual point, attention_heads or router_logits)
    layers: list[int]
    dtype: torch.dtype | None
    select: SelectSpec | None
    sink: Any  # the StreamStore, or the request's RequestCapture
    reduce: str = "all"  # a request's own reduction (a stream's is in its StreamStore)
    budget_rows: int | None = None
    heads: tuple[int, ...] | None = None  # attention patterns: the query heads kept (None: all)
    sae: str | None = None  # sae_features: the worker's key of the SAE that encodes the rows
    top_k: int = 0
    name: str | None = None  # sae_features: the SAE's registered name (the rows' key for callers)
    group: tuple = field(init=False)  # destinations with equal keys share one gather

    def __post_init__(self) -> None:
        self.group = (self.hook, tuple(self.layers), self.dtype, self.heads, self.sae, self.top_k)


@dataclass
class RequestCapture:
    """A request's own captures, accumulated until it finishes."""

    destinations: list["Destination"]
    selectors: dict[tuple, RowSelector] = field(default_factory=dict)  # incl. lazily built stream selectors
    # No destination wants a row before this position (valid while ``plan_version`` matches the
    # session's): steps that stay below it skip the request with one comparison.
    next_position: float = 0
    plan_version: int = -1
    reads_generated_tokens: bool = False
    # Per destination key, one part per step: rows of every layer [layers, n, width], positions, token ids.
    rows: dict[tuple, list[tuple[torch.Tensor, np.ndarray, np.ndarray]]] = field(default_factory=dict)

    def add(self, key: tuple, rows: torch.Tensor, positions: np.ndarray, token_ids: np.ndarray) -> None:
        self.rows.setdefault(key, []).append((rows, positions, token_ids))


@dataclass
class PlannedGroup:
    """The host side of one ``CaptureGroup``: the labels of its rows and who takes which."""

    positions: np.ndarray  # int32 per gathered row
    token_ids: np.ndarray  # int32 per gathered row (PLACEHOLDER until the sampled token is known)
    takers: list[tuple[Destination, Request, np.ndarray]]  # destination, request, its indices into the rows


@dataclass
class Delivery:
    """What the driver keeps of a planned step until its rows arrive."""

    groups: list[PlannedGroup]
    copying_step: int = 0  # the session's count of steps with rows to record, at this one


def plan_step(scheduled: Sequence[ScheduledRequest], positions: np.ndarray, token_ids: np.ndarray,
              query_start: np.ndarray, destinations_of: Any, selector_of: Any,
              serial: int) -> tuple[CapturePlan, Delivery] | None:
    """Rows per (hook, layers, dtype, SAE, top_k) group for one step, or None when nothing is recorded.

    ``destinations_of(request)`` and ``selector_of(request, destination)`` come from the session;
    ``serial`` invalidates each request's cached lower bound on the next position it needs."""
    picks: dict[tuple, list] = {}  # group key -> [(destination, step rows, request)]
    for i, item in enumerate(scheduled):
        request = item.request
        state = request.capture
        end = request.num_computed_tokens + item.num_tokens
        if state is not None and state.plan_version == serial and state.next_position >= end:
            continue
        destinations = destinations_of(request)
        if not destinations:
            continue
        lo, hi = int(query_start[i]), int(query_start[i + 1])
        chunk_positions = positions[lo:hi]
        prompt_len = request.num_prompt_tokens
        next_position = float("inf")
        for destination in destinations:
            selector = selector_of(request, destination)
            next_position = min(next_position, selector.next_position(end, prompt_len))
            if not selector.generation and chunk_positions[0] >= prompt_len:
                continue
            rows = selector.rows(chunk_positions, token_ids[lo:hi], prompt_len, request.max_computed_tokens)
            if len(rows):
                picks.setdefault(destination.group, []).append((destination, rows + lo, request))
        request.capture.next_position, request.capture.plan_version = next_position, serial
    if not picks:
        return None
    groups, planned = [], []
    for (hook, layers, dtype, heads, sae, top_k), entries in picks.items():
        rows, takers = _merge(entries)
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
        groups.append(CaptureGroup(hook, layers, dtype_name, rows, heads, sae, top_k))
        planned.append(PlannedGroup(positions[rows].astype(np.int32), token_ids[rows].astype(np.int32), takers))
    return CapturePlan(groups), Delivery(planned)


def _merge(entries: list[tuple[Destination, np.ndarray, Request]]
           ) -> tuple[np.ndarray, list[tuple[Destination, Request, np.ndarray]]]:
    """A group's gathered rows (sorted, unique) and each taker's indices into them. One destination
    picks disjoint, ascending rows request after request: its rows are their concatenation."""
    first = entries[0][0]
    rows = np.concatenate([e[1] for e in entries]) if len(entries) > 1 else entries[0][1]
    if all(e[0] is first for e in entries):
        ends = np.cumsum([len(e[1]) for e in entries]).tolist()
        starts = [0, *ends[:-1]]
        return rows, [(d, r, np.arange(a, b)) for (d, _, r), a, b in zip(entries, starts, ends)]
    rows = np.unique(rows)
    return rows, [(d, r, np.searchsorted(rows, step_rows)) for d, step_rows, r in entries]
