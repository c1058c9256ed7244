"""A corpus shard's safetensors file, laid out before it is filled: the header is written first
and the tensors are views of the file's own mapped pages, so copying rows into them is writing
the file. Nothing is written afterwards.

Why not write the file from memory at the end: on tmpfs (and the page cache) one file takes
``write``/``pwrite`` calls one at a time (the inode lock), about 3 GB/s on the H200 host whatever
the thread count, and that was most of a corpus run. Pages of a shared mapping are filled by
plain memory copies (no lock, several threads) and are allocated in bulk (``posix_fallocate``,
about 10 GB/s on that host's tmpfs, against about 2 GB/s for one page fault each, which is also
what ``MAP_POPULATE`` costs), by a background thread, chunk by chunk, so capture into a shard
starts as soon as its first rows are reserved.

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
import threading
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
    last view.

    ``allocate`` (typically on another thread) reserves the space: the labels first, then the
    rows chunk by chunk in every layer. A writer calls ``wait_rows(n)`` before writing rows below
    n (and the labels: ``wait_rows(0)``), so it never touches a page the file system has not
    granted: a full disk is then an ``OSError`` here, not a ``SIGBUS`` in the copy.

    ``names`` (name, safetensors dtype of the same item size), one per entry of ``layers``, replaces
    ``layer.L``: SAE features store ``indices`` (I32) and ``values`` (F32) through float32 slots."""

    def __init__(self, path: str | os.PathLike, layers: Sequence[int], rows: int, width: int, dtype: torch.dtype,
                 metadata: dict[str, str] | None = None, names: Sequence[tuple[str, str]] | None = None):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: a shard stores {sorted(str(d) for d in _DTYPES)}, not {dtype}")
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name in LABELS:
            header[name] = {"dtype": "I64", "shape": [rows], "data_offsets": [offset, offset + rows * 8]}
            offset += rows * 8
        self.row_bytes = width * dtype.itemsize
        for name, kind in names or [(f"layer.{layer}", _DTYPES[dtype]) for layer in layers]:
            header[name] = {"dtype": kind, "shape": [rows, width], "data_offsets": [offset, offset + rows * self.row_bytes]}
            offset += rows * self.row_bytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self.start = 8 + len(text)  # where the labels begin; the layers follow them
        self.rows, self.num_layers = rows, len(layers)
        self._ready, self._error, self._cond = (rows if offset == 0 else -1), None, threading.Condition()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask decides, as for any file
        try:
            os.ftruncate(self._fd, self.start + offset)
            head = struct.pack("<Q", len(text)) + text
            if os.pwrite(self._fd, head, 0) != len(head):
                raise OSError(f"{path}: short write of the safetensors header")
            pages = mmap.mmap(self._fd, self.start + offset, flags=mmap.MAP_SHARED) if offset else None
        except BaseException:
            os.close(self._fd)
            raise
        if pages is None:  # no rows: nothing to reserve
            os.close(self._fd)
            self._fd = None
            self.labels = np.empty((len(LABELS), 0), np.int64)
            self.data = torch.empty(len(layers), 0, width, dtype=dtype)
            return
        self.labels = np.frombuffer(pages, np.int64, len(LABELS) * rows, self.start).reshape(len(LABELS), rows)
        self.data = torch.frombuffer(pages, dtype=dtype, count=len(layers) * rows * width,
                                     offset=self.start + len(LABELS) * rows * 8).view(len(layers), rows, width)

    def allocate(self, chunk_rows: int = 4096) -> None:
        """Reserve the labels, then rows ``[0, chunk_rows)`` of every layer, and so on; each chunk
        is released to ``wait_rows`` as soon as it is reserved. Closes the file descriptor."""
        if self._fd is None:
            return
        try:
            if self._ready < self.rows:
                labels_end = self.start + len(LABELS) * self.rows * 8
                _reserve(self._fd, 0, labels_end)
                self._release(0)
                for lo in range(0, self.rows, chunk_rows):
                    hi = min(self.rows, lo + chunk_rows)
                    for i in range(self.num_layers):
                        at = labels_end + (i * self.rows + lo) * self.row_bytes
                        _reserve(self._fd, at, (hi - lo) * self.row_bytes)
                    self._release(hi)
        except BaseException as e:
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        finally:
            os.close(self._fd)
            self._fd = None

    def wait_rows(self, n: int) -> None:
        """Return once rows ``[0, n)`` and the labels may be written; raise if they never will."""
        with self._cond:
            while self._ready < n and self._error is None:
                self._cond.wait()
            if self._ready < n:
                raise OSError(f"shard file: space for rows up to {n} could not be reserved") from self._error

    def _release(self, rows: int) -> None:
        with self._cond:
            self._ready = rows
            self._cond.notify_all()


def _reserve(fd: int, offset: int, length: int) -> None:
    """``posix_fallocate`` where the file system has it (tmpfs allocates pages far faster in bulk
    than one fault each); elsewhere pages come on first touch."""
    if length <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
