"""A growable host log of labelled rows: what a capture stream accumulates, all its layers at once.

Every layer of a stream receives the same rows each step, so the log keeps one set of labels and
chunks shaped ``[layers, rows, width]``: a step is stored with one copy (every layer's rows side by
side, as the step's block holds them) and one label write, whatever the number of layers; a
layer's rows stay contiguous within a chunk, so reading a layer is a view.

Chunks are preallocated: each four times the last up to 16 MiB per layer, then that size, so a
long run takes few allocations, never moves what it stored and holds at most one chunk it does not
fill (growing by four without a cap, a long bulk run's chunks come to about 2.4 times its rows, and
pinning takes time per byte). On a CUDA machine the chunks are pinned: resident pages, and memory
the caching host allocator hands out again once a fetched tensor is dropped, so a capture loop in
steady state takes no page faults. Labels are numpy columns. Memory once handed out is never
written again: a clear drops the chunks instead of reusing them.
"""

from __future__ import annotations

import numpy as np
import torch

_FIRST_CHUNK_ROWS = 1024
_GROWTH = 4
_MAX_CHUNK_BYTES = 16 << 20  # per layer


class RowLog:
    def __init__(self, num_layers: int, pin_memory: bool = False) -> None:
        self.num_layers = num_layers
        self.pin_memory = pin_memory
        self.chunks: list[torch.Tensor] = []  # [layers, capacity, width] each
        self.chunk_start: list[int] = []  # log row of each chunk's first row
        self.used = 0  # rows filled in the last chunk
        self.next_chunk_rows = _FIRST_CHUNK_ROWS  # before the cap
        self.n = 0
        self.owner = np.empty(0, np.int64)  # the store's request index of each row
        self.positions = np.empty(0, np.int32)
        self.token_ids = np.empty(0, np.int32)

    def __len__(self) -> int:
        return self.n

    def append(self, source: torch.Tensor, index: torch.Tensor | None, owner: np.ndarray, positions: np.ndarray,
               token_ids: np.ndarray) -> None:
        """Rows ``source[:, index]`` of every layer (``source[:, :len(owner)]`` when None), labelled
        by the arrays."""
        k = len(owner)
        if not k:
            return
        chunk = self._room(k, source)
        target = chunk[:, self.used:self.used + k]
        target.copy_(source[:, :k] if index is None else source.index_select(1, index))
        self._grow_labels(self.n + k)
        self.owner[self.n:self.n + k] = owner
        self.positions[self.n:self.n + k] = positions
        self.token_ids[self.n:self.n + k] = token_ids
        self.used += k
        self.n += k

    def _room(self, k: int, like: torch.Tensor) -> torch.Tensor:
        """The chunk the next ``k`` rows go to (a new one when the last is full)."""
        if self.chunks and self.used + k <= self.chunks[-1].shape[1]:
            return self.chunks[-1]
        if self.chunks:  # the tail of the full chunk stays unused; its rows end at self.n
            self.chunks[-1] = self.chunks[-1][:, :self.used]
        cap = max(1, _MAX_CHUNK_BYTES // (like.shape[-1] * like.element_size()))
        rows = max(k, min(self.next_chunk_rows, cap))
        self.next_chunk_rows = _GROWTH * rows
        self.chunks.append(torch.empty(self.num_layers, rows, like.shape[-1], dtype=like.dtype,
                                       pin_memory=self.pin_memory))
        self.chunk_start.append(self.n)
        self.used = 0
        return self.chunks[-1]

    def _grow_labels(self, size: int) -> None:
        if size <= len(self.owner):
            return
        capacity = max(size, 2 * len(self.owner), _FIRST_CHUNK_ROWS)
        for name in ("owner", "positions", "token_ids"):
            old = getattr(self, name)
            new = np.empty(capacity, old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    def labels(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owner, positions, token_ids) of every row, in arrival order (views)."""
        return self.owner[:self.n], self.positions[:self.n], self.token_ids[:self.n]

    def rows(self, layer: int, index: np.ndarray | None = None) -> torch.Tensor:
        """Layer ``layer``'s (an index among the log's layers) rows in arrival order (``index``
        None): a view when they sit in one chunk, else one concatenation; or the rows ``index``
        (ascending log rows): one gather per chunk they touch."""
        if index is None:
            parts = [chunk[layer, :self.used] if i == len(self.chunks) - 1 else chunk[layer]
                     for i, chunk in enumerate(self.chunks)]
            return parts[0] if len(parts) == 1 else torch.cat(parts, out=self._new(self.n))
        out = self._new(len(index))
        starts = np.asarray(self.chunk_start)
        chunk_of = np.searchsorted(starts, index, side="right") - 1
        local = torch.from_numpy(index - starts[chunk_of])
        bounds = np.searchsorted(chunk_of, np.arange(len(self.chunks) + 1))
        for c, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            if hi > lo:
                torch.index_select(self.chunks[c][layer], 0, local[lo:hi], out=out[lo:hi])
        return out

    def _new(self, rows: int) -> torch.Tensor:
        first = self.chunks[0]
        return torch.empty(rows, first.shape[-1], dtype=first.dtype, pin_memory=self.pin_memory)

    def keep(self, mask: np.ndarray) -> None:
        """Drop the rows where ``mask`` is False (the rest move to a fresh chunk)."""
        kept = np.flatnonzero(mask)
        if len(kept) == self.n:
            return
        owner, positions, token_ids = (a[kept] for a in self.labels())
        rows = torch.stack([self.rows(i, kept) for i in range(self.num_layers)]) if len(kept) else None
        self.clear()
        if rows is not None:
            self.append(rows, None, owner, positions, token_ids)

    def take_layers(self, layers: list[int]) -> "RowLog":
        """A new log of these layers (indices among this log's) with every row and label (a copy)."""
        log = RowLog(len(layers), self.pin_memory)
        if self.n:
            log.append(torch.stack([self.rows(i) for i in layers]), None, *self.labels())
        return log

    def clear(self) -> None:
        self.chunks, self.chunk_start = [], []
        self.used = self.n = 0
        self.next_chunk_rows = _FIRST_CHUNK_ROWS
