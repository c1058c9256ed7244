"""The engine's lock: first come, first served. A step holds it; a call from another thread (a
control-plane change, an abort, a new request) waits for at most the steps and calls queued before
it, and a stepping loop waits for at most the calls queued before its next step, so neither side
can starve the other. Re-entrant, so a call may make other calls."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineLock:
    def __init__(self) -> None:
        self._state = threading.Condition()
        self._next_ticket = 0
        self._serving = 0
        self._owner: int | None = None
        self._depth = 0

    @contextmanager
    def hold(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._state:
            if self._owner == me:
                self._depth += 1
            else:
                ticket = self._next_ticket
                self._next_ticket += 1
                while self._serving != ticket:
                    self._state.wait()
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._state:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    self._serving += 1
                    self._state.notify_all()
