"""Write a safetensors file straight from the tensors' memory, several threads at once.

The format is an 8-byte little-endian header length, a JSON header (per tensor its dtype, shape
and byte range; ``__metadata__``) padded with spaces to a multiple of 8, then the raw bytes.
``safetensors.torch.save_file`` writes the same bytes (tested), but releases up to at least 0.5
first copy every tensor into a Python ``bytes`` object (a second copy of a multi-gigabyte corpus
shard; safetensors issue 564), and every release writes from one thread, while filling a file's
pages (tmpfs or the page cache) is a kernel memcpy plus page allocation that one thread runs well
below memory speed (about 2 GB/s on tmpfs where a warm memcpy runs at 13). Here each tensor's
memory goes to ``os.pwrite`` as it is, in slices spread over up to half the cores (``pwrite``
releases the GIL; the other half keep the engine's own copies going).
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import torch

# In the order of safetensors' ``Dtype`` enum: a file lists its tensors by that order, last first.
_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64",
           torch.int64: "I64"}
_RANK = {dtype: i for i, dtype in enumerate(_DTYPES)}
WRITE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
SLICE_BYTES = 64 << 20  # a thread's unit of work


def write_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write contiguous CPU ``tensors`` to ``path`` as ``save_file(tensors, path, metadata)`` would
    (the same order: by dtype, then by name)."""
    names = sorted(tensors, key=lambda name: (-_RANK.get(tensors[name].dtype, -1), name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    parts, offset = [], 0  # (data offset, bytes of a tensor)
    for name in names:
        tensor = tensors[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected a contiguous CPU tensor of a safetensors dtype, got "
                             f"{tensor.dtype} on {tensor.device} (contiguous: {tensor.is_contiguous()})")
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        parts.append((offset, data))
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    slices = [(start + at + i, data[i:i + SLICE_BYTES]) for at, data in parts for i in range(0, len(data), SLICE_BYTES)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _pwrite(fd, struct.pack("<Q", len(text)) + text, 0)
        workers = min(WRITE_THREADS, len(slices))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda item: _pwrite(fd, item[1], item[0]), slices))
        else:  # a small file: threads would cost more than they save
            for at, data in slices:
                _pwrite(fd, data, at)
    finally:
        os.close(fd)


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of ``data`` at ``offset`` (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
