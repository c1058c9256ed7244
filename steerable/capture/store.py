"""Where a capture stream's rows accumulate on the host, with their labels, until they are fetched."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerable.capture.serialization import match_capture_request_id, serialize_capture_layer
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



@dataclass
class _Rows:
    tensor: torch.Tensor  # [n, width] on the host
    positions: np.ndarray  # int32 [n]
    token_ids: np.ndarray  # int32 [n]


class StreamStore:
    """Bounded host store for one stream: rows kept per (layer, request) so a client can drain one
    request at a time; every row carries (request id, absolute position, token id)."""

    def __init__(self, config: StreamConfig, layers: list[int], layouts: dict[int, dict[str, int]]):
        self.config = config
        self.layers = layers
        self.layouts = layouts
        self.rows: dict[int, dict[str, list[_Rows]]] = {layer: {} for layer in layers}
        self.request_order: dict[str, int] = {}
        self.layer_rows = dict.fromkeys(layers, 0)
        self.tokens_dropped = 0
        # reduce="last"/"mean": per (request, layer) the running last row or (sum, count).
        self.partial: dict[tuple[str, int], Any] = {}

    @property
    def tokens_stored(self) -> int:
        return sum(self.layer_rows.values())

    def append(self, layer: int, request_id: str, tensor: torch.Tensor, positions: np.ndarray,
               token_ids: np.ndarray) -> None:
        """Rows of one request at one layer, already on the host, in position order."""
        if self.config.reduce == "mean":
            total, count = self.partial.get((request_id, layer), (0.0, 0))
            self.partial[(request_id, layer)] = (total + tensor.float().sum(0), count + len(tensor))
            return
        if self.config.reduce == "last":
            self.partial[(request_id, layer)] = _Rows(tensor[-1:], positions[-1:], token_ids[-1:])
            return
        self._store(layer, request_id, _Rows(tensor, positions, token_ids))

    def _store(self, layer: int, request_id: str, rows: _Rows) -> None:
        n = len(rows.tensor)
        budget = self.config.budget_rows
        if budget is not None:
            keep = max(0, min(n, budget - self.layer_rows[layer]))
            self.tokens_dropped += n - keep
            if keep < n:
                rows = _Rows(rows.tensor[:keep], rows.positions[:keep], rows.token_ids[:keep])
            if keep == 0:
                return
        self.request_order.setdefault(request_id, len(self.request_order))
        self.rows[layer].setdefault(request_id, []).append(rows)
        self.layer_rows[layer] += len(rows.tensor)

    def finish_request(self, request_id: str) -> None:
        """Materialise a reduced row for the request (reduce='last'/'mean')."""
        for layer in self.layers:
            partial = self.partial.pop((request_id, layer), None)
            if partial is None:
                continue
            if self.config.reduce == "mean":
                total, count = partial
                dtype = self.config.dtype or torch.float32
                row = (total / count).to(dtype).unsqueeze(0)
                self._store(layer, request_id, _Rows(row, np.array([-1], np.int32), np.array([-1], np.int32)))
            else:
                self._store(layer, request_id, partial)

    def abort_request(self, request_id: str) -> None:
        for layer in self.layers:
            self.partial.pop((request_id, layer), None)

    def serialize(self, layers: list[int] | None = None, req_ids: list[str] | None = None,
                  clear_selected: bool = False) -> dict[int, dict[str, Any]]:
        """Wire dicts per layer (see ``serialize_capture_layer``); ``req_ids`` are client-visible ids."""
        unknown = [] if layers is None else [layer for layer in layers if layer not in self.rows]
        if unknown:
            raise InvalidRequestError(f"layers: {unknown} are not captured by this stream; captured: {self.layers}")
        wanted = self.layers if layers is None else list(layers)
        result = {}
        for layer in wanted:
            by_request = self.rows[layer]
            ids = sorted(by_request, key=self.request_order.__getitem__)
            if req_ids is not None:
                ids = [rid for rid in ids if any(match_capture_request_id(rid, c) for c in req_ids)]
            if not ids:
                continue
            chunks = [(i, rows) for i, rid in enumerate(ids) for rows in by_request[rid]]
            tensor = torch.cat([rows.tensor for _, rows in chunks])
            labels = np.concatenate([np.stack([np.full(len(rows.positions), i, np.int32), rows.positions,
                                               rows.token_ids], axis=1) for i, rows in chunks])
            result[layer] = serialize_capture_layer(tensor, torch.from_numpy(labels), ids, self.layouts.get(layer))
            if clear_selected:
                for rid in ids:
                    self.layer_rows[layer] -= sum(len(r.tensor) for r in by_request.pop(rid))
        if clear_selected:  # drained requests are forgotten, so a long-running stream stays bounded
            for rid in [r for r in self.request_order if not any(r in rows for rows in self.rows.values())]:
                del self.request_order[rid]
        return result

    def clear(self) -> None:
        """Drop stored rows and counters; reductions of running requests keep accumulating."""
        for layer in self.layers:
            self.rows[layer].clear()
            self.layer_rows[layer] = 0
        self.request_order.clear()
        self.tokens_dropped = 0

    def status(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "rows_stored": dict(self.layer_rows),
            "tokens_stored": self.tokens_stored,
            "tokens_dropped": self.tokens_dropped,
            "budget_rows": self.config.budget_rows,
            "reduce": self.config.reduce,
            "select": self.config.select.to_wire() if self.config.select is not None else None,
            "dtype": str(self.config.dtype).removeprefix("torch.") if self.config.dtype else None,
            "requests": len(self.request_order),
            "pending_reductions": len(self.partial),
        }
