"""The float32 CPU engine's fused kernels (``csrc/cpu_kernels.cpp``), built on first use.

On a CPU a decode step of a small model spent over 40 % of its time outside its matrix products
(SmolLM2-135M at 64 rows, one core: ~135 of ~310 ms): attention copied every cached K/V row into a
padded batch before reading it again, and norms, rotary and SwiGLU were a dozen eager ops a layer,
each a pass over memory and a dispatch. These kernels do each in one pass, the attention reading the
paged cache in place. They are compiled once per machine by PyTorch's extension builder (a C++
compiler and ninja; cached under ``TORCH_EXTENSIONS_DIR``, ``~/.cache/torch_extensions`` by
default) for the host's instruction set; without a compiler, or with ``STEERABLE_CPU_KERNELS=0``,
the engine keeps its PyTorch ops (same results to the last bit or two).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_kernels.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _host_tag() -> str:
    """The host's instruction set, in the build's name: a build with ``-march=native`` must not be
    loaded on another kind of CPU that shares the cache directory."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags or torch.backends.cpu.get_cpu_capability()).encode()).hexdigest()[:10]


def build_directory() -> str:
    """Where the kernels are built and cached: ``$TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``
    by default), one folder per Python version and host."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_cpu",
                        f"steerable_cpu_kernels_{_host_tag()}")


@contextlib.contextmanager
def _one_builder(folder: str) -> Iterator[None]:
    """PyTorch's builder marks a build in progress with a ``lock`` file that it never clears if it is
    killed mid-build, and every later build of that folder then waits on it forever. Builders of
    ours take an ``flock`` instead, which the kernel releases when its holder dies; holding it, any
    ``lock`` file is such a leftover, and goes."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): PyTorch's own lock alone
        yield
        return
    with open(os.path.join(folder, "steerable-build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, "lock"))
        yield


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    folder = build_directory()
    logger.info("CPU kernels: loading, or building once for this host (about 30 s on 2 cores; cached in %s)", folder)
    try:
        os.makedirs(folder, exist_ok=True)
        with _one_builder(folder):
            return cpp_extension.load(name=os.path.basename(folder), sources=[_SOURCE], build_directory=folder,
                                      extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
                                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler or ninja, or a build that fails here: PyTorch ops instead
        logger.warning("CPU kernels unavailable (%s: %s); using PyTorch ops", type(err).__name__, err)
        return None


def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they are off or cannot be built (the first call builds,
    once per process; a cached build loads in under a second)."""
    global _module, _tried
    if not _tried:
        with _lock:
            if not _tried:
                if os.environ.get("STEERABLE_CPU_KERNELS", "1") != "0":
                    _module = _build()
                _tried = True
    return _module


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: float32 on a CPU (and the kernels are built)."""
    for t in tensors:  # called a few times a layer: attribute checks only
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return kernels() is not None
