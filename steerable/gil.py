"""How quickly the GIL changes hands while a long offline run drives a GPU."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

# A long run on a GPU has the engine's thread and its helpers (the capture sink, the shard buffers,
# the file writer) each launching kernels or copies op by op, every op releasing the GIL and taking it
# back; a thread that asks for it waits up to the switch interval (5 ms by default) while another runs
# Python. 0.1 ms took the dashboards pass from 43.8 to 50.0 % of sparse capture on an H100.
RUN_SWITCH_INTERVAL_S = 1e-4

_lock = threading.Lock()
_depth = 0
_previous = 0.0


@contextlib.contextmanager
def quick_handoff(device_type: str) -> Iterator[None]:
    """On a CUDA device, hand the GIL over every ``RUN_SWITCH_INTERVAL_S`` while the block runs, then
    restore the interval found at the outermost entry (nested and concurrent runs share one
    setting). Elsewhere nothing changes: a CPU run's threads compute, and more switches would only
    cost them."""
    global _depth, _previous
    if device_type != "cuda":
        yield
        return
    with _lock:
        if _depth == 0:
            _previous = sys.getswitchinterval()
            sys.setswitchinterval(RUN_SWITCH_INTERVAL_S)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.setswitchinterval(_previous)
