"""Python's garbage collector during long offline runs."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_ours = False  # whether the outermost run froze the heap (it was not frozen before)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive when a run starts out of Python's collections while it runs.

    A run creates thousands of container objects a second (requests, their plans and outputs), so
    the collector runs often, and each full collection walks every tracked object: the model's
    modules and what torch and transformers hold, ~250k. ``gc.freeze()`` moves them to a
    generation no collection walks (vLLM does it once after start-up); ``gc.unfreeze()`` on the
    way out gives them back, so nothing created before the run stays uncollectable after it. One
    full collection comes first: garbage frozen with the rest could not be collected during the
    run, and back-to-back runs, no full collection between them, would keep it for good (a test
    process running the docs' examples grew to 14.6 GB). Meant for long runs (corpus capture, dashboards,
    activation streams), whose length that collection (tens of ms) is small against.
    Nested and concurrent runs share one freeze, undone when the last of them ends. A heap the
    application froze itself (as vLLM does after start-up) is left as it is: no second freeze, and no
    ``unfreeze`` that would undo the application's."""
    global _depth, _ours
    with _lock:
        if _depth == 0:
            _ours = gc.get_freeze_count() == 0
            if _ours:
                gc.collect()
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _ours:
                gc.unfreeze()
