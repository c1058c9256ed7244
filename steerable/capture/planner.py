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
from steerable.step import PLACEHOLDER, CaptureGroup, CapturePlan


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
        all_from = select.selects_all_from(len(prompt))
        if all_from <= 0:  # every row (a corpus capture's): no positions to list per request
            return cls(select, None, select.may_select_generation(), 0)
        return cls(select, np.asarray(select.prompt_positions_selected(prompt), dtype=np.int64),
                   select.may_select_generation(), all_from)

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
    # Valid while ``plan_version`` matches: from position ``decode_from`` on, a decode row goes to each
    # of ``decode_takers`` (group, destination) and no other destination wants it; planning a
    # decode step then takes one lookup per destination, no selector work.
    decode_from: float = float("inf")
    decode_takers: list[tuple[tuple, "Destination"]] = field(default_factory=list)
    # Per destination key, one part per step: rows of every layer [layers, n, width] as host numpy
    # (``host_array``: 16-bit floats as their bits) or rows the activation store served (``StoredRows``),
    # positions, token ids; and the rows' torch dtype.
    rows: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(default_factory=dict)
    dtypes: dict[tuple, torch.dtype] = field(default_factory=dict)

    def add(self, key: tuple, rows: Any, dtype: torch.dtype, positions: np.ndarray,
            token_ids: np.ndarray) -> None:
        """``rows``: ``[layers, n, width]`` host numpy, or ``StoredRows`` the activation store served."""
        self.rows.setdefault(key, []).append((rows, positions, token_ids))
        self.dtypes[key] = dtype


def host_array(block: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor (bfloat16 and float16 as int16 bits, which numpy can index):
    a request's rows of a step are cut from it with numpy, far cheaper per request than torch ops."""
    return (block.view(torch.int16) if block.element_size() == 2 and block.is_floating_point() else block).numpy()


def as_tensor(rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``host_array``'s inverse: the rows as a tensor of ``dtype`` (no copy)."""
    tensor = torch.from_numpy(rows)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


@dataclass
class PlannedGroup:
    """The host side of one ``CaptureGroup``: the labels of its rows and who takes which."""

    positions: np.ndarray  # int32 per gathered row
    token_ids: np.ndarray  # int32 per gathered row (PLACEHOLDER until the sampled token is known)
    takers: list[tuple[Destination, Request, np.ndarray]]  # destination, request, its indices into the rows
    consecutive: bool = False  # every taker's indices are a consecutive range (delivery slices them)
    key: tuple = ()  # the destinations' ``group``: hook, layers, dtype, heads, SAE, top-k

    def fill_pending_tokens(self) -> None:
        """Rows planned while their input token was still being sampled carry PLACEHOLDER labels; by
        delivery that token is known."""
        token_ids, positions = self.token_ids, self.positions
        pending = token_ids == PLACEHOLDER
        if not pending.any():
            return
        pending, position_of = pending.tolist(), positions.tolist()
        for _, request, where in self.takers:
            if request.finished or request.paused:
                continue
            if len(where) == 1:  # a decode row: scalar work
                i = int(where[0])
                if pending[i]:
                    token_ids[i] = request.all_token_ids[position_of[i]]
                continue
            for i in where.tolist():
                if pending[i]:
                    token_ids[i] = request.all_token_ids[position_of[i]]


@dataclass
class Delivery:
    """What the driver keeps of a planned step until its rows arrive."""

    groups: list[PlannedGroup]
    copying_step: int = 0  # the session's count of steps with rows to record, at this one
    served: list[Any] = field(default_factory=list)  # prefix_rows.ServedRows: rows the activation store serves


def plan_step(scheduled: Sequence[ScheduledRequest], positions: np.ndarray, token_ids: np.ndarray,
              query_start: np.ndarray, destinations_of: Any, selector_of: Any,
              serial: int) -> tuple[CapturePlan, Delivery] | None:
    """Rows per (hook, layers, dtype, SAE, top_k) group for one step, or None when nothing is recorded.

    ``destinations_of(request)`` and ``selector_of(request, destination)`` come from the session;
    ``serial`` invalidates each request's cached lower bound on the next position it needs."""
    picks: dict[tuple, list] = {}  # group key -> [(destination, step rows or one step row, request)]
    repeats: set[tuple] = set()  # groups where one request has several destinations (their rows may overlap)
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
        chunk_start = int(positions[lo])
        state = request.capture
        if (hi - lo == 1 and state is not None and state.plan_version == serial and chunk_start >= state.decode_from
                and chunk_start >= request.max_computed_tokens):
            for group, destination in state.decode_takers:  # the common decode row: no selector work
                if group in picks and picks[group][-1][2] is request:
                    repeats.add(group)
                picks.setdefault(group, []).append((destination, lo, request))
            state.next_position = end
            continue
        prompt_len = request.num_prompt_tokens
        next_position = float("inf")
        seen: set[tuple] = set()
        decode_from, decode_takers = float(prompt_len), []
        for destination in destinations:
            selector = selector_of(request, destination)
            next_position = min(next_position, selector.next_position(end, prompt_len))
            if selector.generation:
                decode_from = max(decode_from, selector.all_from)
                decode_takers.append((destination.group, destination))
            if not selector.generation and chunk_start >= prompt_len:
                continue
            rows = selector.rows(positions[lo:hi], token_ids[lo:hi], prompt_len, request.max_computed_tokens)
            if not len(rows):
                continue
            group = destination.group
            if group in seen:
                repeats.add(group)
            seen.add(group)
            picks.setdefault(group, []).append((destination, rows + lo, request))
        state = request.capture
        state.next_position, state.plan_version = next_position, serial
        state.decode_from, state.decode_takers = decode_from, decode_takers
    if not picks:
        return None
    groups, planned = [], []
    for key, entries in picks.items():
        hook, layers, dtype, heads, sae, top_k = key
        overlapping = key in repeats
        rows, takers = _merge(entries, overlapping)
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
        groups.append(CaptureGroup(hook, layers, dtype_name, rows, heads, sae, top_k))
        planned.append(PlannedGroup(positions[rows].astype(np.int32), token_ids[rows].astype(np.int32), takers,
                                    consecutive=not overlapping, key=key))
    return CapturePlan(groups), Delivery(planned)


def _merge(entries: list[tuple[Destination, np.ndarray | int, Request]], overlapping: bool
           ) -> tuple[np.ndarray, list[tuple[Destination, Request, np.ndarray]]]:
    """A group's gathered rows (sorted, unique) and each taker's indices into them. Requests come in
    step order and each picks ascending rows of its own chunk, so unless one request has several
    destinations in the group (``overlapping``), the rows are the picks' concatenation and each
    taker's indices a consecutive range (one row for a decode step, kept as an int until here)."""
    if not overlapping:
        sizes = [1 if isinstance(e[1], int) else len(e[1]) for e in entries]
        if len(sizes) == sum(sizes):  # decode rows only: the common case, no array per taker
            rows = np.fromiter((e[1] if isinstance(e[1], int) else e[1][0] for e in entries), np.int64, len(entries))
        else:
            rows = np.concatenate([np.array([e[1]]) if isinstance(e[1], int) else e[1] for e in entries])
        index = np.arange(len(rows))
        takers, start = [], 0
        for (d, _, r), n in zip(entries, sizes):
            takers.append((d, r, index[start:start + n]))
            start += n
        return rows, takers
    picked = [np.array([e[1]]) if isinstance(e[1], int) else e[1] for e in entries]
    rows = np.unique(np.concatenate(picked))
    return rows, [(d, r, np.searchsorted(rows, step_rows)) for (d, _, r), step_rows in zip(entries, picked)]
