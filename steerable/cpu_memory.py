"""Keep a CPU engine's freed activations in the process heap instead of handing them back to the OS.

A CPU step allocates its activations fresh at every op: at 2,048 tokens of SmolLM2-135M the
gate/up product alone is 25 MB. glibc's malloc serves blocks above its mmap threshold (128 KiB at
first, raised only as far as the largest block freed) with a new ``mmap`` each time and trims the
heap's free top back to the OS above 128 KiB, so the next step faults every page in again and the
kernel zeroes it. On one core of a Zen 4 box that was ~1 s of a 64-prompt prefill's 11 s
(docs/benchmarks.md, cpu_duel). ``keep_freed_memory`` raises the mmap threshold to glibc's
largest (32 MiB) and the trim threshold to 256 MiB, as vLLM-CPU gets from tcmalloc, so a step's
blocks are reused from the heap; ``release_freed_memory`` (an engine's shutdown) hands every free
page back, so a process that runs engines one after another (a test suite, a notebook) does not
keep the last one's memory. Process-wide and only where glibc is the allocator. Opt-in
(``STEERABLE_CPU_MALLOC=1``): with it on by default, a CI worker that ran docs/scale.md's
examples (SmolLM2, SAELens training and Ray in one process) died in two of three runs, cause not
yet found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

ENV = "STEERABLE_CPU_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's ceiling for it on 64-bit hosts (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 256 * 2**20

_applied = False
_libc: ctypes.CDLL | None = None


def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; whether they are in effect."""
    global _applied, _libc
    if _applied:
        return True
    if os.environ.get(ENV, "0") != "1":
        return False
    libc = _glibc()
    if libc is None:
        return False
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        logger.warning("CPU engine: glibc refused the malloc thresholds; activations are mapped afresh every step")
        return False
    _applied, _libc = True, libc
    logger.info("CPU engine: freed blocks under %d MiB stay in the heap (trimmed above %d MiB)",
                MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20)
    return True


def release_freed_memory() -> None:
    """Return the free pages of every arena to the system (``malloc_trim``), where the thresholds
    are in effect: what an engine freed at shutdown would otherwise stay with the process."""
    if _libc is not None:
        _libc.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    """glibc, if this process runs on it (musl and macOS have no ``mallopt`` of these meanings)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc
