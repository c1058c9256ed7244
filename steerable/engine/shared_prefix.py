"""Find the KV prefix that a step's decode rows share, from the host copy of their block tables.

Rows share a prefix when their tables start with the same physical block ids: the prefix cache
hands one computed block to every request whose tokens (and steering, through the block hashes)
match it, and only whole, computed blocks are ever shared, so a prefix that ends mid-block stops
at its last whole block. One group per step: the rows whose first block is the most common one,
cut at the length that saves the most reads (``(members - 1) * shared blocks``). Thresholds keep
the second pass off where it costs more than it saves (FlashInfer and TensorRT-LLM use about 256
shared tokens and 8 requests). Pure numpy on arrays the step builder already holds: no device sync.
"""

from __future__ import annotations

import numpy as np


class SharedPrefixDetector:
    def __init__(self, block_size: int, min_tokens: int, min_requests: int):
        self.block_size = block_size
        self.min_blocks = max(1, -(-min_tokens // block_size))
        self.min_requests = max(2, min_requests)

    def detect(self, table: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> np.ndarray | None:
        """Per decode row, the tokens of the shared prefix it is given (0 outside the group), or None
        when no group clears the thresholds. ``table``: one KV group's block rows by slot;
        ``seq_lens``: each row's length including the token being decoded."""
        bs = self.block_size
        full = (seq_lens - 1) // bs  # whole blocks before each row's current token
        eligible = np.flatnonzero(full >= self.min_blocks)
        if len(eligible) < self.min_requests:
            return None
        first = table[slots[eligible], 0]
        values, counts = np.unique(first, return_counts=True)
        top = counts.argmax()
        if counts[top] < self.min_requests:
            return None
        members = eligible[first == values[top]]
        width = int(full[members[0]])
        rows = table[slots[members], :width]
        same = rows == rows[0]
        runs = np.where(same.all(axis=1), width, same.argmin(axis=1))
        runs = np.minimum(runs, full[members])
        by_run = np.sort(runs)[::-1]
        count = np.arange(1, len(by_run) + 1)
        gain = np.where((count >= self.min_requests) & (by_run >= self.min_blocks), (count - 1) * by_run, 0)
        best = int(gain.argmax())
        if gain[best] <= 0:
            return None
        shared = int(by_run[best])
        lengths = np.zeros(len(slots), dtype=np.int64)
        lengths[members[runs >= shared]] = shared * bs
        return lengths
