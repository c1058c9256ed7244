"""Stream sinks that copy on their own thread: a corpus shard's sink copies a step's rows (hundreds
of megabytes) from the step's pinned host block to the shard file, which on the engine's thread
would stall every next launch. Here those appends run, in step order, on one background thread
while the engine launches the next steps; the engine only waits for an append before it launches
the step whose device-to-host copy reuses the host block that append reads."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class SinkThread:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="capture-sink")
        self._pending: deque[tuple[int, Future]] = deque()  # (copying step, its appends), oldest first

    def submit(self, step: int, append: Callable[[Any], None], rows: Any) -> None:
        self._pending.append((step, self._pool.submit(append, rows)))

    def wait_before(self, step: int) -> None:
        """Every append of a copying step before ``step`` has returned; raises the first failure."""
        while self._pending and self._pending[0][0] < step:
            self._pending.popleft()[1].result()

    def drain(self) -> None:
        """Every append has returned (raises the first failure; the rest still finish)."""
        try:
            while self._pending:
                self._pending.popleft()[1].result()
        finally:
            for _, future in self._pending:
                future.exception()
            self._pending.clear()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)
