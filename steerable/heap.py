"""Python's garbage collector during long offline runs."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive when a run starts out of Python's collections while it runs.

    A run creates thousands of container objects a second (requests, their plans and outputs), so
    the collector runs often, and each full collection walks every tracked object: the model's
    modules and what torch and transformers hold, ~250k. ``gc.freeze()`` moves them to a
    generation no collection walks (vLLM does it once after start-up); ``gc.unfreeze()`` on the
    way out gives them back, so nothing created before the run stays uncollectable after it.
    Nested and concurrent runs share one freeze, undone when the last of them ends."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
