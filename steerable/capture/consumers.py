"""Sinks for finished captures: write them to disk as safetensors shards, or log them.

A consumer gets each finished request's capture once (``on_capture``) and is closed when the
engine shuts down.  Consumers run on the engine's side, so they must never trust request ids
or stream names as paths and must never leave a half-written file behind for a reader.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open

from steerable.capture.serialization import CaptureMeta, _req_index
from steerable.files import create_part, write_safetensors

__all__ = ["CaptureConsumer", "FilesystemConsumer", "LoggingConsumer", "read_capture_shard",
           "SHARD_FORMAT", "KNOWN_STREAMS"]

SHARD_FORMAT = "steerable-capture-v1"
KNOWN_STREAMS = frozenset({"hidden_states", "attention_heads", "router_logits"})
_STREAM = re.compile(r"[A-Za-z0-9_]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_KEY = re.compile(r"layer\.(\d+)(?:\.(positions|token_ids|req_idx))?")
_MAX_NAME = 120  # keep file names well under the usual 255-byte limit


@runtime_checkable
class CaptureConsumer(Protocol):
    """Receives each finished request's capture: ``tensors[layer]`` rows labelled by ``meta[layer]``."""

    def on_capture(self, request_id: str, stream: str, tensors: dict[int, torch.Tensor],
                   meta: dict[int, CaptureMeta]) -> None: ...

    def close(self) -> None: ...


def _check(tensors: dict[int, torch.Tensor], meta: dict[int, CaptureMeta]) -> None:
    if set(tensors) != set(meta):
        raise ValueError(f"capture layers {sorted(tensors)} and labels {sorted(meta)} differ")
    for layer, t in tensors.items():
        if t.ndim != 2 or t.shape[0] != len(meta[layer]):
            raise ValueError(f"capture layer {layer}: tensor {tuple(t.shape)} vs {len(meta[layer])} labels")


def _owned(t: torch.Tensor) -> torch.Tensor:
    """CPU, contiguous and sole owner of its storage (safetensors rejects shared storage)."""
    t = t.detach().cpu().contiguous()
    if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _safe_stem(request_id: str) -> str:
    """A single path component from an untrusted id: no separators, no leading dots, bounded length."""
    stem = re.sub(r"^\.+", "_", _UNSAFE.sub("_", str(request_id)))[:_MAX_NAME]
    return stem or "capture"


class FilesystemConsumer:
    """Writes one safetensors shard per capture at ``<root>/<stream>/<id>.<n>.safetensors``.

    Readable by :func:`read_capture_shard` or plain ``safetensors.torch.load_file``.  Writes
    go to a temp file in the target directory then ``os.replace``, so readers only ever see
    complete shards.  ``fsync=True`` also flushes each shard to stable storage before the rename.
    """

    def __init__(self, root: str | os.PathLike, fsync: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = self.root.resolve()
        self.fsync = fsync
        self.paths: list[Path] = []
        self._counter = 0
        self._lock = threading.Lock()
        self._closed = False

    def _target(self, request_id: str, stream: str) -> Path:
        if not isinstance(stream, str) or not (stream in KNOWN_STREAMS or _STREAM.fullmatch(stream)):
            raise ValueError(f"capture stream name {stream!r} is not allowed (letters, digits, '_')")
        directory = self.root / stream
        directory.mkdir(exist_ok=True)
        stem = _safe_stem(request_id)
        with self._lock:
            # The counter keeps repeated ids apart; skipping existing names keeps an earlier
            # consumer's shards in the same root intact too.
            while True:
                self._counter += 1
                path = directory / f"{stem}.{self._counter:06d}.safetensors"
                if not path.exists():
                    break
        if not path.resolve().is_relative_to(self._root):
            raise ValueError(f"capture path {path} escapes the consumer root {self._root}")
        return path

    def on_capture(self, request_id: str, stream: str, tensors: dict[int, torch.Tensor],
                   meta: dict[int, CaptureMeta]) -> None:
        if self._closed:
            raise RuntimeError("FilesystemConsumer is closed")
        _check(tensors, meta)
        path = self._target(request_id, stream)
        table, _ = _req_index([r for layer in sorted(meta) for r in meta[layer].req_ids])
        lookup = {r: i for i, r in enumerate(table)}
        payload: dict[str, torch.Tensor] = {}
        for layer in sorted(tensors):
            m = meta[layer]
            payload[f"layer.{layer}"] = _owned(tensors[layer])
            payload[f"layer.{layer}.positions"] = _owned(m.positions.to(torch.int32))
            payload[f"layer.{layer}.token_ids"] = _owned(m.token_ids.to(torch.int32))
            payload[f"layer.{layer}.req_idx"] = torch.tensor([lookup[r] for r in m.req_ids], dtype=torch.int32)
        metadata = {"request_ids": json.dumps(table), "stream": stream, "format": SHARD_FORMAT}
        tmp = create_part(path.parent, ".tmp-")
        try:
            write_safetensors(payload, tmp, metadata=metadata)
            if self.fsync:
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self.paths.append(path)

    def close(self) -> None:
        self._closed = True


def read_capture_shard(path: str | os.PathLike) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta]]:
    """Load a shard written by :class:`FilesystemConsumer` back into ``(tensors, meta)``."""
    with safe_open(str(path), framework="pt") as f:
        info = f.metadata() or {}
        if info.get("format") != SHARD_FORMAT:
            raise ValueError(f"{path} is not a {SHARD_FORMAT} shard (format={info.get('format')!r})")
        table = json.loads(info.get("request_ids", "null"))
        if not isinstance(table, list) or not all(isinstance(r, str) for r in table):
            raise ValueError(f"{path} has no valid request_ids table")
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for key in f.keys():
            m = _KEY.fullmatch(key)
            if m is None:
                raise ValueError(f"{path} has unexpected tensor {key!r}")
            parts.setdefault(int(m.group(1)), {})[m.group(2) or "data"] = f.get_tensor(key)
    tensors: dict[int, torch.Tensor] = {}
    metas: dict[int, CaptureMeta] = {}
    for layer in sorted(parts):
        p = parts[layer]
        if set(p) != {"data", "positions", "token_ids", "req_idx"}:
            raise ValueError(f"{path} layer {layer} is incomplete: has {sorted(p)}")
        rows = p["data"].shape[0]
        idx = p["req_idx"]
        if any(p[c].shape != (rows,) or p[c].dtype != torch.int32 for c in ("positions", "token_ids", "req_idx")):
            raise ValueError(f"{path} layer {layer} labels do not match its {rows} rows")
        if rows and (int(idx.min()) < 0 or int(idx.max()) >= len(table)):
            raise ValueError(f"{path} layer {layer} has req_idx outside request_ids")
        tensors[layer] = p["data"]
        metas[layer] = CaptureMeta([table[i] for i in idx.tolist()], p["positions"], p["token_ids"])
    return tensors, metas


class LoggingConsumer:
    """Logs one line per capture; ``num_captures``/``num_rows`` (rows summed over layers) count them."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO):
        self.logger = logger or logging.getLogger("steerable.capture")
        self.level = level
        self.num_captures = 0
        self.num_rows = 0
        self._lock = threading.Lock()

    def on_capture(self, request_id: str, stream: str, tensors: dict[int, torch.Tensor],
                   meta: dict[int, CaptureMeta]) -> None:
        rows = {layer: int(t.shape[0]) for layer, t in sorted(tensors.items())}
        with self._lock:
            self.num_captures += 1
            self.num_rows += sum(rows.values())
        if not self.logger.isEnabledFor(self.level):
            return

        def one(values: dict[int, object]) -> object:  # uniform across layers (the usual case): one value
            return next(iter(values.values())) if len(set(values.values())) == 1 else values

        items = sorted(tensors.items())
        self.logger.log(self.level, "capture request=%s stream=%s layers=%d rows=%s dtype=%s width=%s",
                        request_id, stream, len(items), one(rows),
                        one({k: str(t.dtype).removeprefix("torch.") for k, t in items}),
                        one({k: int(t.shape[-1]) if t.ndim else 1 for k, t in items}))

    def close(self) -> None:
        pass
