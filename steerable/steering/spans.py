"""What each live request's steering last resolved a decode row to, kept in arrays so a decode step
reads every request's at once: the table row and the positions [lo, hi) over which it holds.
A request's row holds for every position when it has no selections, for every generated one
when its selections cannot tell them apart, and up to the next boundary of its windows and
position lists otherwise; a decode step resolves only the requests whose position left it."""

from __future__ import annotations

import numpy as np

LO, HI, ROW = range(3)


class DecodeSpans:
    def __init__(self, capacity: int = 64):
        # Key 0 is every unsteered request's: row 0 at every position. A fresh key holds nowhere.
        self.entries = np.zeros((3, capacity), dtype=np.float64)
        self.entries[HI, 0] = np.inf
        self._free: list[int] = []
        self._next = 1

    def new(self) -> int:
        """A key for one request's steering; its span is empty until ``set``."""
        if self._free:
            key = self._free.pop()
        else:
            key = self._next
            self._next += 1
            if key == self.entries.shape[1]:
                self.entries = np.concatenate([self.entries, np.zeros_like(self.entries)], axis=1)
        self.reset(key)
        return key

    def free(self, key: int) -> None:
        self._free.append(key)

    @property
    def live(self) -> int:
        """Keys in use: requests (and ``n``-request templates) holding steering."""
        return self._next - 1 - len(self._free)

    def reset(self, key: int) -> None:
        """Forget what ``key`` resolved (its request's prompt grew, or it is new)."""
        self.entries[:, key] = 0.0

    def set(self, key: int, lo: float, hi: float, row: int) -> None:
        self.entries[:, key] = lo, hi, row

    def gather(self, keys: np.ndarray) -> np.ndarray:
        """float64 [3, len(keys)]: lo, hi and row of each key (a copy)."""
        return self.entries[:, keys]
