"""One corpus shard assembled in place: each captured row is copied once, from the step's host
block straight to its place in the shard file (``ShardFile``'s mapped pages).

A shard holds examples ``[first, first + len(counts))`` in example-then-position order, and each
example's row count is known before it runs (its selected prompt positions: one token is generated
and never fed back), so example e's rows have a fixed place, ``data[:, offset[e]:offset[e + 1]]``.
The engine hands a step's rows of a stream over as one block ``[layers, rows, width]``
(``CaptureSession.start(sink=...)``); a request's rows come in position order and consecutive
requests are usually consecutive examples, so a step usually lands with one strided copy of every
layer at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from steerable.capture.shard_file import LABELS
from steerable.capture.store import StreamRows


class ShardBuffer:
    """Places each step's rows of examples ``[first, first + len(counts))`` (``counts[i]`` rows
    each) into ``data`` (``[layers, rows, width]``) and ``labels`` (``[3, rows]``: example,
    position, token id), usually a ``ShardFile``'s views (then ``wait_rows`` is its own).
    ``append`` may run on the capture session's sink thread (through ``ShardRouter``), in step
    order; ``expect`` is called on the engine's thread before a request's first rows, and the
    engine's thread reads ``complete`` and ``error``."""

    def __init__(self, first: int, counts: Sequence[int], data: torch.Tensor, labels: np.ndarray,
                 wait_rows: Callable[[int], None] | None = None):
        self.wait_rows = wait_rows  # called before writing below a row: the storage may still be reserving it
        self.first, self.counts = first, np.asarray(counts, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])  # where each example's rows start
        self.filled = np.zeros(len(self.counts), np.int64)  # rows each example got so far
        self.example_of: dict[str, int] = {}  # engine request id -> example index in the shard
        self.error: OSError | None = None  # the storage could not take rows
        self.rows_stored = 0
        if data.shape[1] != self.rows or labels.shape != (len(LABELS), self.rows):
            raise ValueError(f"shard storage: {self.rows} rows needed, data has {data.shape[1]}, "
                             f"labels {labels.shape[1]}")
        self.data, self.labels = data, labels
        if wait_rows is not None:
            wait_rows(0)
        self.labels[0] = np.repeat(np.arange(first, first + len(self.counts)), self.counts)

    @property
    def rows(self) -> int:
        return int(self.offsets[-1])

    def expect(self, request_id: str, example: int) -> None:
        """Rows of engine request ``request_id`` belong to corpus example ``example``."""
        self.example_of[request_id] = example - self.first

    def append(self, rows: StreamRows) -> None:
        """A step's rows (the engine calls this while ``rows.block`` is valid)."""
        unknown = [rid for rid in rows.request_ids if rid not in self.example_of]
        if unknown:
            raise RuntimeError(f"corpus capture: rows of request {unknown[0]!r}, which is not one of this shard's")
        local = np.fromiter(map(self.example_of.__getitem__, rows.request_ids), np.int64, len(rows.request_ids))
        start = self.offsets[local] + self.filled[local]
        over = np.flatnonzero(self.filled[local] + rows.counts > self.counts[local])
        if len(over):
            e = local[over[0]]
            raise RuntimeError(f"corpus capture: example {self.first + e} got more than its {self.counts[e]} "
                               "selected prompt rows")
        self.filled[local] += rows.counts
        first_row = np.cumsum(rows.counts) - rows.counts  # each request's first row among the step's
        target = np.arange(len(rows.where)) + np.repeat(start - first_row, rows.counts)
        if self.wait_rows is not None and len(target):
            try:
                self.wait_rows(int(target.max()) + 1)
            except OSError as e:  # the caller's to raise (``check``): the engine's other requests go on
                self.error = self.error or e
                return
        self.labels[1, target] = rows.positions
        self.labels[2, target] = rows.token_ids
        for src, dst, n in _runs(rows.where, target):
            self.data[:, dst:dst + n].copy_(rows.block[:, src:src + n])
        self.rows_stored += len(target)  # after the copies: another thread may be waiting for the last row

    @property
    def complete(self) -> bool:
        return self.rows_stored == self.rows

    def check(self) -> None:
        """Raise the storage's failure, if rows could not be stored."""
        if self.error is not None:
            raise self.error

    def check_complete(self) -> None:
        """Every example got all its rows (a shard is written only then)."""
        self.check()
        short = np.flatnonzero(self.filled != self.counts)
        if len(short):
            e = short[0]
            raise RuntimeError(f"corpus capture: example {self.first + e} got {self.filled[e]} of its "
                               f"{self.counts[e]} selected prompt rows")


def _runs(src: np.ndarray, dst: np.ndarray) -> Iterable[tuple[int, int, int]]:
    """(source row, target row, length) of each longest stretch where both advance one by one."""
    if not len(src):
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist())


class ShardRouter:
    """The sink of a whole corpus run: each request's rows go to its shard's buffer, so one
    capture stream serves every shard and the engine never drains between them. A step's rows
    usually belong to one shard; where they straddle two, each gets its own slice.

    A request is known by its engine id (``expect``) or, when the engine admits it later from a
    queue, by its client id (``expect_client``): its first rows then tie its engine id, the client
    id plus ``-`` and 8 hex digits, to the example."""

    threaded = True

    def __init__(self) -> None:
        self.buffer_of: dict[str, ShardBuffer] = {}  # engine request id -> its shard's buffer
        self.by_client: dict[str, tuple[ShardBuffer, int]] = {}  # queued client id -> (buffer, example)

    def expect(self, request_id: str, buffer: ShardBuffer, example: int) -> None:
        self.buffer_of[request_id] = buffer
        buffer.expect(request_id, example)

    def expect_client(self, client_id: str, buffer: ShardBuffer, example: int) -> None:
        self.by_client[client_id] = (buffer, example)

    def forget(self, buffer: ShardBuffer) -> None:
        """A finished shard's requests."""
        for request_id in buffer.example_of:
            self.buffer_of.pop(request_id, None)
        for client_id in [c for c, (b, _) in self.by_client.items() if b is buffer]:
            self.by_client.pop(client_id, None)

    def _claim(self, request_id: str) -> ShardBuffer | None:
        """The buffer of a queued request's first rows (engine id = client id + "-" + 8 hex)."""
        claimed = self.by_client.pop(request_id.rpartition("-")[0], None)
        if claimed is None:
            return None
        buffer, example = claimed
        self.expect(request_id, buffer, example)
        return buffer

    def append(self, rows: StreamRows) -> None:
        owners = [self.buffer_of.get(rid) or self._claim(rid) for rid in rows.request_ids]
        if None in owners:
            rid = rows.request_ids[owners.index(None)]
            raise RuntimeError(f"corpus capture: rows of request {rid!r}, which is not one of this run's")
        if all(owner is owners[0] for owner in owners):
            owners[0].append(rows)
            return
        ends = np.cumsum(rows.counts)
        i = 0
        while i < len(owners):
            j = i
            while j + 1 < len(owners) and owners[j + 1] is owners[i]:
                j += 1
            a, b = int(ends[i] - rows.counts[i]), int(ends[j])
            owners[i].append(StreamRows(rows.block, rows.where[a:b], rows.request_ids[i:j + 1], rows.counts[i:j + 1],
                                        rows.positions[a:b], rows.token_ids[a:b]))
            i = j + 1
