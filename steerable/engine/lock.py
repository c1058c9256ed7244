"""The engine's lock. Steps hold it; a call from another thread (a control-plane change, an abort,
a new request) waits for at most the step in progress: the stepping thread lets waiting callers
in before it takes the lock for its next step, so a busy loop of steps cannot starve them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineLock:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state = threading.Condition(threading.Lock())
        self._waiting = 0

    @contextmanager
    def call(self) -> Iterator[None]:
        """Hold the engine for one call (re-entrant, so a call may make others)."""
        if self._lock.acquire(blocking=False):
            try:
                yield
            finally:
                self._lock.release()
            return
        with self._state:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._state:
                self._waiting -= 1
                self._state.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Hold the engine for one step, after every caller already waiting has had its turn."""
        with self._state:
            while self._waiting:
                self._state.wait()
        with self._lock:
            yield
