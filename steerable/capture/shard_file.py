"""A corpus shard's safetensors file, laid out before it is filled: the header is written first
and the tensors are views of the file's own mapped pages, so copying rows into them is writing
the file. Nothing is written afterwards.

Why not write the file from memory at the end: on tmpfs (and the page cache) one file takes
``write``/``pwrite`` calls one at a time (the inode lock), about 3 GB/s on the H200 host whatever
the thread count, and that was most of a corpus run. Pages of a shared mapping are filled by
plain memory copies (no lock, several threads) and are allocated in bulk (``posix_fallocate``,
about 10 GB/s on that host's tmpfs, against about 2 GB/s for one page fault each, which is also
what ``MAP_POPULATE`` costs), so ``ShardFile`` can be made by a background thread while the
previous shard is captured.

The format is an 8-byte little-endian header length, a JSON header (per tensor its dtype, shape
and byte range; ``__metadata__``) padded with spaces to a multiple of 8, then the raw bytes.
Here the label tensors come first and the layers follow in ascending order, so all layers are one
``[layers, rows, width]`` block and all labels one ``[3, rows]`` block; readers go by the byte
ranges, not by the order (``save_file`` would sort by dtype and name).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from collections.abc import Sequence

import numpy as np
import torch

LABELS = ("example", "position", "token_id")  # int64, one value per row
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


class ShardFile:
    """The file at ``path`` (created or truncated) holding ``layer.L`` ``[rows, width]`` for each
    of ``layers`` and the int64 labels. ``data`` (``[layers, rows, width]``) and ``labels``
    (``[3, rows]``: example, position, token id) are views of its pages: what is copied into them
    is in the file, visible to readers as soon as it is copied. The mapping goes away with the
    last view."""

    def __init__(self, path: str | os.PathLike, layers: Sequence[int], rows: int, width: int, dtype: torch.dtype,
                 metadata: dict[str, str] | None = None):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: a shard stores {sorted(str(d) for d in _DTYPES)}, not {dtype}")
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name in LABELS:
            header[name] = {"dtype": "I64", "shape": [rows], "data_offsets": [offset, offset + rows * 8]}
            offset += rows * 8
        layer_bytes = rows * width * dtype.itemsize
        for layer in layers:
            header[f"layer.{layer}"] = {"dtype": _DTYPES[dtype], "shape": [rows, width],
                                        "data_offsets": [offset, offset + layer_bytes]}
            offset += layer_bytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, start + offset)
            _allocate(fd, start + offset)
            head = struct.pack("<Q", len(text)) + text
            if os.pwrite(fd, head, 0) != len(head):
                raise OSError(f"{path}: short write of the safetensors header")
            pages = mmap.mmap(fd, start + offset, flags=mmap.MAP_SHARED) if offset else None
        finally:
            os.close(fd)  # the mapping keeps the file open
        if pages is None:
            self.labels = np.empty((len(LABELS), 0), np.int64)
            self.data = torch.empty(len(layers), 0, width, dtype=dtype)
            return
        self.labels = np.frombuffer(pages, np.int64, len(LABELS) * rows, start).reshape(len(LABELS), rows)
        self.data = torch.frombuffer(pages, dtype=dtype, count=len(layers) * rows * width,
                                     offset=start + len(LABELS) * rows * 8).view(len(layers), rows, width)


def _allocate(fd: int, size: int) -> None:
    """Reserve the file's space now: a full disk fails here with ``OSError`` rather than later as a
    ``SIGBUS`` on a mapped page, and tmpfs allocates pages far faster in bulk than one fault each."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # a filesystem without it: pages on touch
            raise
