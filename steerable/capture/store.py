"""Where a capture stream's rows accumulate on the host, with their labels, until they are fetched.

A step's rows reach a stream as one block of every layer (every request's rows at once), so storing
is one copy into the stream's ``RowLog``, reductions are a table update per layer, and a fetch is
one gather per layer: no work per request in Python.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from steerable.capture.rowlog import RowLog
from steerable.capture.serialization import CaptureMeta, match_capture_request_id, serialize_capture_layer
from steerable.checks import float_dtype, is_int
from steerable.errors import InvalidRequestError
from steerable.selection import SelectSpec

logger = logging.getLogger(__name__)

REDUCTIONS = ("all", "last", "mean")


def check_reduction(reduce: str, budget_rows: int | None, prefix: str = "") -> None:
    """``reduce`` is one of ``REDUCTIONS`` and ``budget_rows`` a non-negative integer or None."""
    if reduce not in REDUCTIONS:
        raise InvalidRequestError(f"{prefix}reduce: must be one of {list(REDUCTIONS)}, got {reduce!r}")
    if budget_rows is not None and (not is_int(budget_rows) or budget_rows < 0):
        raise InvalidRequestError(f"{prefix}budget_rows: must be a non-negative integer or None, got {budget_rows!r}")


def reduce_rows(tensor: torch.Tensor, positions: np.ndarray, token_ids: np.ndarray, reduce: str,
                budget_rows: int | None, dtype: torch.dtype | None) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """One request's rows (position order) reduced as a stream reduces them: the "last" row, or
    the float32 "mean" as ``dtype`` (float32 when None) without position or token (-1); then at
    most ``budget_rows`` rows."""
    if reduce == "last":
        tensor, positions, token_ids = tensor[-1:], positions[-1:], token_ids[-1:]
    elif reduce == "mean" and len(tensor):
        mean = tensor.float().sum(0) / len(tensor)
        tensor = mean.to(dtype or torch.float32).unsqueeze(0)
        positions, token_ids = np.array([-1], np.int32), np.array([-1], np.int32)
    if budget_rows is not None:
        tensor, positions, token_ids = tensor[:budget_rows], positions[:budget_rows], token_ids[:budget_rows]
    return tensor, positions, token_ids


def resolve_storage_dtype(dtype: str | torch.dtype | None, field: str = "dtype") -> torch.dtype | None:
    return None if dtype is None else float_dtype(dtype, field)


class StreamConfig:
    """Per-stream capture configuration, validated when the stream starts.

    ``select`` (a SelectSpec or its wire dict) picks rows and needs ``reduce="all"``; ``"last"`` and
    ``"mean"`` reduce each request to one row when it finishes; ``budget_rows`` caps stored rows per
    layer (later rows are dropped and counted).
    """

    def __init__(self, layers: list[int] | None = None, dtype: str | None = None, reduce: str = "all",
                 select: Any = None, budget_rows: int | None = None):
        check_reduction(reduce, budget_rows)
        if reduce != "all" and select is not None:
            raise InvalidRequestError("select: row selection cannot be combined with reduce='last'/'mean'; "
                             "use reduce='all' with a select clause")
        self.select = SelectSpec.parse(select) if select is not None else None
        self.layers = sorted(set(layers)) if layers is not None else None
        self.dtype = resolve_storage_dtype(dtype)
        self.reduce = reduce
        self.budget_rows = budget_rows
        if reduce == "all" and select is None and budget_rows is None:
            logger.warning("capture stream started with reduce='all', no select and no budget_rows: every row of "
                           "every request accumulates in host memory; prefer a select clause, a reduction or a "
                           "budget for long runs")


class StreamRows:
    """One step's rows for a stream: ``block[layer_index][where]``, ``counts[i]`` consecutive rows of
    ``request_ids[i]`` (in position order), with their labels."""

    __slots__ = ("block", "where", "request_ids", "counts", "positions", "token_ids")

    def __init__(self, block: torch.Tensor, where: np.ndarray, request_ids: list[str], counts: np.ndarray,
                 positions: np.ndarray, token_ids: np.ndarray):
        self.block = block  # [layers, step rows, width] on the host
        self.where = where  # int64 [n]
        self.request_ids = request_ids
        self.counts = counts  # int64, one per request
        self.positions = positions  # int32 [n]
        self.token_ids = token_ids  # int32 [n]


class StreamStore:
    """Bounded host store for one stream: per layer a log of rows labelled (request, absolute
    position, token id), in the order they were computed (so a request's rows by position)."""

    def __init__(self, config: StreamConfig, layers: list[int], layouts: dict[int, dict[str, int]],
                 pin_memory: bool = False):
        self.config = config
        self.layers = layers
        self.layouts = layouts
        self.pin_memory = pin_memory
        # Layers whose rows are the same share a log: all of them, until a fetch drains some only.
        self.groups = [_LayerGroup(layers, None, RowLog(len(layers), pin_memory))]
        self.owner_of: dict[str, int] = {}  # request id -> its index in the logs' owner column
        self.ids: dict[int, str] = {}
        self._next_owner = 0
        self.tokens_dropped = 0
        self.reduction = _Reduction(config.reduce, len(layers)) if config.reduce != "all" else None

    @property
    def tokens_stored(self) -> int:
        return sum(len(group.log) * len(group.layers) for group in self.groups)

    def append(self, rows: StreamRows) -> None:
        """A step's rows of every layer, already on the host."""
        if self.reduction is not None:
            self.reduction.add(rows)
            return
        owners = np.repeat(np.fromiter((self._owner(rid) for rid in rows.request_ids), np.int64,
                                       len(rows.request_ids)), rows.counts)
        where = rows.where
        n = len(where)
        every = n == rows.block.shape[1] and (n == 0 or (where[0] == 0 and where[-1] == n - 1))
        for group in self.groups:
            keep = self._room(group, n)
            index = None if every else torch.from_numpy(where[:keep])
            group.log.append(group.of(rows.block), index, owners[:keep], rows.positions[:keep], rows.token_ids[:keep])

    def _owner(self, request_id: str) -> int:
        owner = self.owner_of.get(request_id)
        if owner is None:
            owner = self.owner_of[request_id] = self._next_owner
            self.ids[owner] = request_id
            self._next_owner += 1
        return owner

    def _room(self, group: "_LayerGroup", n: int) -> int:
        """How many of ``n`` new rows the budget lets the group's layers keep (the rest are counted
        dropped, once per layer)."""
        budget = self.config.budget_rows
        keep = n if budget is None else max(0, min(n, budget - len(group.log)))
        self.tokens_dropped += (n - keep) * len(group.layers)
        return keep

    def finish_request(self, request_id: str) -> None:
        """Materialise the request's reduced row (reduce='last'/'mean')."""
        if self.reduction is None:
            return
        reduced = self.reduction.pop(request_id, self.config.dtype)
        if reduced is None:
            return
        rows, position, token_id = reduced
        owner = np.array([self._owner(request_id)], np.int64)
        for group in self.groups:
            if self._room(group, 1):
                group.log.append(group.of(rows[:, None]), None, owner, np.array([position], np.int32),
                                 np.array([token_id], np.int32))

    def abort_request(self, request_id: str) -> None:
        if self.reduction is not None:
            self.reduction.pop(request_id, None)

    def pending_requests(self) -> list[str]:
        """Requests with a reduction not yet materialised."""
        return self.reduction.requests() if self.reduction is not None else []

    # ------------------------------------------------------------ reading

    def fetch(self, layers: list[int] | None = None, req_ids: list[str] | None = None,
              clear_selected: bool = False) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta]]:
        """Per layer the rows of the selected requests (``req_ids``: client-visible ids) in the order
        they were computed, and their labels: every row is a view of the log (or one concatenation),
        a subset one gather. Labels are built once per log (once for all layers, unless a fetch drained
        some layers alone)."""
        wanted = self._wanted(layers)
        tensors, metas = {}, {}
        for group in list(self.groups):
            mine = [layer for layer in group.layers if layer in wanted]
            if not mine:
                continue
            if clear_selected and len(mine) < len(group.layers):
                group = self._split(group, mine)
            log = group.log
            owner, positions, token_ids = log.labels()
            index = None if req_ids is None else np.flatnonzero(self._selected(owner, req_ids))
            if index is not None:
                owner, positions, token_ids = owner[index], positions[index], token_ids[index]
            if not len(owner):
                continue
            table, inverse = np.unique(owner, return_inverse=True)
            names = np.array([self.ids[o] for o in table.tolist()], dtype=object)[inverse].tolist()
            for layer in mine:
                tensors[layer] = log.rows(group.layers.index(layer), index)
                metas[layer] = CaptureMeta(names, torch.from_numpy(positions.copy()),
                                           torch.from_numpy(token_ids.copy()))
            if clear_selected:
                if index is None:
                    log.clear()
                else:
                    log.keep(~self._selected(log.labels()[0], req_ids))
        if clear_selected:  # drained requests are forgotten, so a long-running stream stays bounded
            self._forget_drained()
        return {layer: tensors[layer] for layer in wanted if layer in tensors}, \
            {layer: metas[layer] for layer in wanted if layer in metas}

    def _split(self, group: "_LayerGroup", layers: list[int]) -> "_LayerGroup":
        """Give ``layers`` of the group a log of their own (a copy; the rest keep theirs, with
        every row): a fetch is about to drain them alone."""
        self.groups.remove(group)
        parts = [[layer for layer in group.layers if layer not in layers], layers]
        split = [_LayerGroup(part, torch.tensor([self.layers.index(layer) for layer in part]),
                             group.log.take_layers([group.layers.index(layer) for layer in part]))
                 for part in parts]
        self.groups += split
        return split[1]

    def serialize(self, layers: list[int] | None = None, req_ids: list[str] | None = None,
                  clear_selected: bool = False) -> dict[int, dict[str, Any]]:
        """Wire dicts per layer (see ``serialize_capture_layer``): for sending rows to another
        process; in-process readers use ``fetch``."""
        tensors, metas = self.fetch(layers, req_ids, clear_selected)
        result = {}
        for layer, tensor in tensors.items():
            meta = metas[layer]
            table, req_idx = np.unique(np.array(meta.req_ids, dtype=object), return_inverse=True)
            labels = torch.stack([torch.from_numpy(req_idx.astype(np.int32)), meta.positions, meta.token_ids], 1)
            result[layer] = serialize_capture_layer(tensor, labels, table.tolist(), self.layouts.get(layer))
        return result

    def _group_of(self, layer: int) -> "_LayerGroup":
        return next(group for group in self.groups if layer in group.layers)

    def _wanted(self, layers: list[int] | None) -> list[int]:
        unknown = [] if layers is None else [layer for layer in layers if layer not in self.layers]
        if unknown:
            raise InvalidRequestError(f"layers: {unknown} are not captured by this stream; captured: {self.layers}")
        return self.layers if layers is None else list(layers)

    def _selected(self, owner: np.ndarray, req_ids: list[str]) -> np.ndarray:
        """Which rows belong to the requests asked for."""
        wanted = [o for rid, o in self.owner_of.items() if any(match_capture_request_id(rid, c) for c in req_ids)]
        return np.isin(owner, np.asarray(wanted, np.int64))

    def _forget_drained(self) -> None:
        live = set()
        for group in self.groups:
            live.update(np.unique(group.log.labels()[0]).tolist())
        for owner in [o for o in self.ids if o not in live]:
            del self.owner_of[self.ids.pop(owner)]

    def clear(self) -> None:
        """Drop stored rows and counters; reductions of running requests keep accumulating."""
        self.groups = [_LayerGroup(self.layers, None, RowLog(len(self.layers), self.pin_memory))]
        self.owner_of.clear()
        self.ids.clear()
        self.tokens_dropped = 0

    def status(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "rows_stored": {layer: len(self._group_of(layer).log) for layer in self.layers},
            "tokens_stored": self.tokens_stored,
            "tokens_dropped": self.tokens_dropped,
            "budget_rows": self.config.budget_rows,
            "reduce": self.config.reduce,
            "select": self.config.select.to_wire() if self.config.select is not None else None,
            "dtype": str(self.config.dtype).removeprefix("torch.") if self.config.dtype else None,
            "requests": len(self.owner_of),
            "pending_reductions": len(self.pending_requests()) * len(self.layers),
        }


class _LayerGroup:
    """Layers of a stream that store the same rows, in one log. ``block_index``: where their rows
    sit in a step's block (None: the block is exactly theirs)."""

    __slots__ = ("layers", "block_index", "log")

    def __init__(self, layers: list[int], block_index: torch.Tensor | None, log: RowLog):
        self.layers = list(layers)
        self.block_index = block_index
        self.log = log

    def of(self, block: torch.Tensor) -> torch.Tensor:
        """The group's layers of a block ``[stream layers, rows, width]``."""
        return block if self.block_index is None else block.index_select(0, self.block_index)


class _Reduction:
    """Running reductions of live requests, one table row per request for all layers at once:
    float32 sums and counts (``mean``), or the last row with its labels (``last``)."""

    def __init__(self, kind: str, num_layers: int):
        self.kind = kind
        self.num_layers = num_layers
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []
        self.table: torch.Tensor | None = None  # [layers, slots, width]
        self.count = np.zeros(0, np.int64)
        self.position = np.zeros(0, np.int32)
        self.token_id = np.zeros(0, np.int32)

    def requests(self) -> list[str]:
        return list(self.slot_of)

    def _slot(self, request_id: str) -> int:
        slot = self.slot_of.get(request_id)
        if slot is None:
            slot = self.free.pop() if self.free else len(self.slot_of)
            self.slot_of[request_id] = slot
            self.count[slot] = 0
            self.table[:, slot] = 0  # a reused slot starts a fresh sum
        return slot

    def _reserve(self, rows: StreamRows) -> None:
        """Room for one more slot per request in ``rows`` (tables grow by doubling)."""
        need = len(self.slot_of) + len(rows.request_ids)
        block = rows.block
        dtype = torch.float32 if self.kind == "mean" else block.dtype
        if self.table is None:
            self.table = torch.zeros(self.num_layers, 0, block.shape[-1], dtype=dtype)
        if need <= self.table.shape[1]:
            return
        size = max(need, 2 * self.table.shape[1], 16)
        table = torch.zeros(self.num_layers, size, block.shape[-1], dtype=dtype)
        table[:, :self.table.shape[1]] = self.table
        self.table = table
        for name in ("count", "position", "token_id"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.zeros(size - len(old), old.dtype)]))

    def add(self, rows: StreamRows) -> None:
        if not len(rows.request_ids):
            return
        self._reserve(rows)
        slots = np.fromiter((self._slot(rid) for rid in rows.request_ids), np.int64, len(rows.request_ids))
        slots_t = torch.from_numpy(slots)
        block = rows.block
        if self.kind == "mean":
            per_row = torch.from_numpy(np.repeat(slots, rows.counts))
            where = torch.from_numpy(rows.where)
            for i in range(self.num_layers):
                self.table[i].index_add_(0, per_row, block[i].index_select(0, where).float())
            np.add.at(self.count, slots, rows.counts)
            return
        last = np.cumsum(rows.counts) - 1  # each request's rows are in position order
        where = torch.from_numpy(rows.where[last])
        for i in range(self.num_layers):
            self.table[i].index_copy_(0, slots_t, block[i].index_select(0, where))
        self.count[slots] = 1
        self.position[slots] = rows.positions[last]
        self.token_id[slots] = rows.token_ids[last]

    def pop(self, request_id: str, dtype: torch.dtype | None) -> tuple[torch.Tensor, int, int] | None:
        """The request's reduced rows ``[layers, width]`` and their labels; None when it saw no row."""
        slot = self.slot_of.pop(request_id, None)
        if slot is None:
            return None
        self.free.append(slot)
        if dtype is None and self.kind == "mean":
            dtype = torch.float32
        if self.kind == "mean":
            rows = (self.table[:, slot] / int(self.count[slot])).to(dtype)
            return rows, -1, -1
        rows = self.table[:, slot].clone()
        return rows.to(dtype) if dtype is not None else rows, int(self.position[slot]), int(self.token_id[slot])
