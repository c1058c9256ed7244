"""How many intra-op threads a CPU engine uses.

PyTorch's intra-op pool splits each op over all cores and waits at a barrier for every thread.
When other processes keep those cores busy, one descheduled thread stalls the whole op: on a
2-core machine with both cores loaded, a 64 x 576 x 576 matmul took 15.6 ms with two threads
against 0.69 ms with one (docs/server.md, "CPU threads"). So the engine asks for the cores that
are free when it starts (the one-minute load average subtracted from the cores this process may
run on), never fewer than one; ``cpu_threads=N`` (``--cpu-threads``, ``STEERABLE_CPU_THREADS``)
sets it outright.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "STEERABLE_CPU_THREADS"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_cores() -> int:
    """Cores not taken by other work now: usable cores minus the one-minute load average."""
    cores = usable_cores()
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    return max(1, min(cores, int(cores - busy + 0.5)))


def choose(requested: int | None, ranks_sharing: int = 1) -> int:
    """The thread count for one engine process (or one of ``ranks_sharing`` ranks on the host)."""
    if requested is None and os.environ.get(ENV):
        try:
            requested = int(os.environ[ENV])
        except ValueError:
            raise ValueError(f"{ENV} must be an integer >= 1, got {os.environ[ENV]!r}") from None
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"cpu_threads must be None or an integer >= 1, got {requested!r}")
        return requested
    return max(1, free_cores() // ranks_sharing)


def apply(requested: int | None, ranks_sharing: int = 1) -> int:
    import torch

    threads = choose(requested, ranks_sharing)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        logger.info("CPU engine: %d intra-op thread(s) (%d usable cores)", threads, usable_cores())
    return threads
