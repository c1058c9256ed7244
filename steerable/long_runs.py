"""The interpreter's settings while a long offline run (corpus capture, a dashboards pass, an
activation stream) drives the engine: the garbage collector's frozen heap and, on a GPU, how quickly
the GIL changes hands. Both are process-wide, so nested and concurrent runs share one setting,
made by the first to enter and undone by the last to leave."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

# A long run on a GPU has the engine's thread and its helpers (the capture sink, the shard buffers,
# the file writer) each launching kernels or copies op by op, every op releasing the GIL and taking it
# back; a thread that asks for it waits up to the switch interval (5 ms by default) while another runs
# Python. 0.1 ms took the dashboards pass from 43.8 to 50.0 % of sparse capture on an H100.
RUN_SWITCH_INTERVAL_S = 1e-4


class _SharedSetting:
    """``apply()`` when the first run enters, ``undo(state)`` with what it returned when the last leaves."""

    def __init__(self, apply: Callable[[], Any], undo: Callable[[Any], None]):
        self._apply, self._undo = apply, undo
        self._lock = threading.Lock()
        self._depth = 0
        self._state: Any = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._state = self._apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._undo(self._state)


def _freeze() -> bool:
    """Whether this run froze the heap (a heap the application froze itself is left as it is)."""
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True


def _unfreeze(ours: bool) -> None:
    if ours:
        gc.unfreeze()


def _quick_switch() -> float:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(RUN_SWITCH_INTERVAL_S)
    return previous


_HEAP = _SharedSetting(_freeze, _unfreeze)
_GIL = _SharedSetting(_quick_switch, sys.setswitchinterval)


def frozen_heap() -> contextlib.AbstractContextManager[None]:
    """Keep the objects alive when a run starts out of Python's collections while it runs.

    A run creates thousands of container objects a second (requests, their plans and outputs), so
    the collector runs often, and each full collection walks every tracked object: the model's
    modules and what torch and transformers hold, ~250k. ``gc.freeze()`` moves them to a
    generation no collection walks (vLLM does it once after start-up); ``gc.unfreeze()`` on the
    way out gives them back, so nothing created before the run stays uncollectable after it. One
    full collection comes first: garbage frozen with the rest could not be collected during the
    run, and back-to-back runs, no full collection between them, would keep it for good (a test
    process running the docs' examples grew to 14.6 GB). Meant for long runs, whose length that
    collection (tens of ms) is small against. A heap the application froze itself (as vLLM does
    after start-up) is left as it is: no second freeze, and no ``unfreeze`` that would undo the
    application's."""
    return _HEAP.held()


def quick_handoff(device_type: str) -> contextlib.AbstractContextManager[None]:
    """On a CUDA device, hand the GIL over every ``RUN_SWITCH_INTERVAL_S`` while the block runs, then
    restore the interval found when the first run entered. Elsewhere nothing changes: a CPU run's
    threads compute, and more switches would only cost them."""
    return _GIL.held() if device_type == "cuda" else contextlib.nullcontext()
