"""One corpus shard assembled in place: each captured row is copied once, from the step's host
block straight to where the shard file wants it.

A shard holds examples ``[first, first + len(counts))`` in example-then-position order, and each
example's row count is known before it runs (its selected prompt positions: one token is generated
and never fed back), so example e's rows have a fixed place, ``data[:, offset[e]:offset[e + 1]]``.
The engine hands a step's rows of a stream over as one block ``[layers, rows, width]``
(``CaptureSession.start(sink=...)``); a request's rows come in position order and consecutive
requests are usually consecutive examples, so a step usually lands with one strided copy of every
layer at once. ``data[i, :rows]`` is contiguous, so the writer takes each layer as it is, and the
storage is reused by the next shard (no fresh pages to fault in after the first).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from steerable.capture.store import StreamRows

LABELS = ("example", "position", "token_id")


class ShardBuffer:
    def __init__(self, num_layers: int, width: int, dtype: torch.dtype):
        self.data = torch.empty(num_layers, 0, width, dtype=dtype)
        self.labels = np.empty((len(LABELS), 0), np.int64)  # per row: example, position, token id
        self.first = 0
        self.counts = np.zeros(0, np.int64)  # rows each example must get
        self.offsets = np.zeros(1, np.int64)  # where each example's rows start
        self.filled = np.zeros(0, np.int64)  # rows each example got so far
        self.example_of: dict[str, int] = {}  # engine request id -> example index in the shard

    @property
    def rows(self) -> int:
        return int(self.offsets[-1])

    def reset(self, first: int, counts: Sequence[int]) -> None:
        """Hold examples ``first, first + 1, ...`` with ``counts[i]`` rows each (earlier contents
        are dropped; storage grows only when it must)."""
        self.first, self.counts = first, np.asarray(counts, np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)])
        self.filled = np.zeros(len(self.counts), np.int64)
        self.example_of = {}
        if self.rows > self.data.shape[1]:
            layers, _, width = self.data.shape
            dtype = self.data.dtype
            self.data = self.labels = None  # the old storage goes before the new one is taken
            self.data = torch.empty(layers, self.rows, width, dtype=dtype)
            self.labels = np.empty((len(LABELS), self.rows), np.int64)
        self.labels[0, :self.rows] = np.repeat(np.arange(first, first + len(self.counts)), self.counts)

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
        self.labels[1, target] = rows.positions
        self.labels[2, target] = rows.token_ids
        for src, dst, n in _runs(rows.where, target):
            self.data[:, dst:dst + n].copy_(rows.block[:, src:src + n])

    def check_complete(self) -> None:
        """Every example got all its rows (a shard is written only then)."""
        short = np.flatnonzero(self.filled != self.counts)
        if len(short):
            e = short[0]
            raise RuntimeError(f"corpus capture: example {self.first + e} got {self.filled[e]} of its "
                               f"{self.counts[e]} selected prompt rows")

    def tensors(self, layers: Sequence[int]) -> dict[str, torch.Tensor]:
        """The shard's tensors (views of the buffer): ``layer.L`` and the int64 labels."""
        out = {f"layer.{layer}": self.data[i, :self.rows] for i, layer in enumerate(layers)}
        out.update({name: torch.from_numpy(self.labels[j, :self.rows]) for j, name in enumerate(LABELS)})
        return out


def _runs(src: np.ndarray, dst: np.ndarray) -> Iterable[tuple[int, int, int]]:
    """(source row, target row, length) of each longest stretch where both advance one by one."""
    if not len(src):
        return []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [len(src)]]))
    return zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist())
