"""Attention patterns as they are delivered: ragged rows of per-head probabilities over the keys a
query row attended to, and the key ranges both sides of the capture plane derive from a row's
position and its layer's sliding window.

A pattern row of query position p covers keys ``key_start .. p`` (``key_start`` = 0 on a full
attention layer, ``max(0, p - window + 1)`` on a sliding-window one), so rows have different
lengths: they are kept as a list, with ``padded()`` for a dense view. On the way from the worker
a step's rows travel padded to the step's longest key range (``[layers, rows, heads * width]``,
zeros past each row's length), which ``assemble`` cuts back into rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from steerable.capture.sparse import SparseFeatures


def key_ranges(positions: np.ndarray, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(key_starts, key_lens), int32 per query position, on a layer with ``window`` (None: full)."""
    positions = np.asarray(positions, np.int64)
    starts = np.zeros_like(positions) if window is None else np.maximum(positions - window + 1, 0)
    return starts.astype(np.int32), (positions + 1 - starts).astype(np.int32)


def padded_width(positions: np.ndarray, windows: Sequence[int | None]) -> int:
    """The longest key range of ``positions`` over layers with ``windows``: a step's padded width."""
    if not len(positions):
        return 0
    return max(int(key_ranges(positions, w)[1].max()) for w in windows)


@dataclass
class AttentionPatterns:
    """One layer's captured patterns: ``rows[i]`` is ``[len(heads), key_lens[i]]`` (float), the
    softmax of query row i (labelled by the matching ``CaptureMeta`` row) over keys
    ``key_starts[i]`` onwards; ``heads`` are the query heads kept, in head order."""

    rows: list[torch.Tensor]
    key_starts: torch.Tensor  # int32 [rows]
    key_lens: torch.Tensor  # int32 [rows]
    heads: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        keys = f"{int(self.key_lens.min())}-{int(self.key_lens.max())}" if len(self.rows) else "none"
        dtype = str(self.dtype).removeprefix("torch.") if self.dtype is not None else None
        return f"AttentionPatterns(rows={len(self)}, heads={self.heads}, keys per row={keys}, dtype={dtype})"

    @property
    def dtype(self) -> torch.dtype | None:
        return self.rows[0].dtype if self.rows else None

    def padded(self) -> torch.Tensor:
        """``[rows, heads, max_key_len]``, zeros past each row's key length."""
        width = int(self.key_lens.max()) if len(self.rows) else 0
        out = torch.zeros(len(self.rows), len(self.heads), width, dtype=self.dtype or torch.float32)
        for i, row in enumerate(self.rows):
            out[i, :, :row.shape[1]] = row
        return out

    def select(self, index: Sequence[int]) -> AttentionPatterns:
        index = list(index)
        return AttentionPatterns([self.rows[i] for i in index], self.key_starts[index], self.key_lens[index],
                                 list(self.heads))

    @staticmethod
    def concat(parts: Sequence[AttentionPatterns]) -> AttentionPatterns:
        """Rows of ``parts`` in order (as ``CaptureMeta.concat`` stacks their labels)."""
        heads = list(parts[0].heads) if parts else []
        if any(list(p.heads) != heads for p in parts):
            raise ValueError("heads: patterns of different heads cannot be concatenated")
        return AttentionPatterns([r for p in parts for r in p.rows],
                                 torch.cat([p.key_starts for p in parts]) if parts else torch.empty(0, dtype=torch.int32),
                                 torch.cat([p.key_lens for p in parts]) if parts else torch.empty(0, dtype=torch.int32),
                                 heads)


def concat_captured(parts: Sequence[torch.Tensor | AttentionPatterns | SparseFeatures]
                    ) -> torch.Tensor | AttentionPatterns | SparseFeatures:
    """One layer's (or SAE's) captured rows of several parts in order: ``torch.cat``, patterns'
    rows joined, or SAE features' rows stacked."""
    if parts and isinstance(parts[0], AttentionPatterns):
        return AttentionPatterns.concat(parts)
    if parts and isinstance(parts[0], SparseFeatures):
        return SparseFeatures.cat(parts)
    return torch.cat(list(parts))


def assemble(blocks: Sequence[torch.Tensor], positions: np.ndarray, window: int | None,
             heads: list[int]) -> AttentionPatterns:
    """A layer's patterns from its padded step blocks (``[rows, len(heads) * width]`` each, rows in
    the order of ``positions``, the concatenation of every block's query positions)."""
    starts, lens = key_ranges(positions, window)
    rows, at = [], 0
    for block in blocks:
        width = block.shape[1] // max(len(heads), 1)
        view = block.view(block.shape[0], len(heads), width)
        rows.extend(view[j, :, :lens[at + j]] for j in range(block.shape[0]))
        at += block.shape[0]
    return AttentionPatterns(rows, torch.from_numpy(starts), torch.from_numpy(lens), list(heads))
