"""Where a corpus capture writes: a local directory, or any fsspec URL (``s3://bucket/acts``,
``gs://...``, ``file:///shared/acts``) that every worker of a cluster can reach.

Nothing appears under its final name half-written. A file is built under a temporary ``.part``
name (locally: in the directory itself; for a URL: in a local temp directory, then uploaded under a
temporary name) and renamed into place by one committer, so a reader, or a resumed run, sees a
shard either whole or not at all, whatever process died when.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any


def is_url(where: str | os.PathLike) -> bool:
    return "://" in str(where)


class OutputDir:
    """A directory (``where``: a path or an fsspec URL) and the few operations a run needs."""

    def __init__(self, where: str | os.PathLike):
        self.where = str(where)
        self.fs: Any = None
        if is_url(where):
            import fsspec  # a dependency of huggingface_hub

            self.fs, self.root = fsspec.core.url_to_fs(self.where)
        else:
            self.root = str(Path(where))
        self._staging: str | None = None

    @property
    def local(self) -> bool:
        return self.fs is None

    def __truediv__(self, name: str) -> "OutputDir":
        return OutputDir(f"{self.where.rstrip('/')}/{name}")

    def path(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local else f"{self.root.rstrip('/')}/{name}"

    def __str__(self) -> str:
        return self.where

    # ------------------------------------------------------------ reading

    def exists(self, name: str = "") -> bool:
        where = self.path(name) if name else self.root
        return os.path.exists(where) if self.local else self.fs.exists(where)

    def listdir(self) -> list[str]:
        """Names in the directory (none if it does not exist)."""
        if not self.exists():
            return []
        if self.local:
            return sorted(os.listdir(self.root))
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))

    def read_bytes(self, name: str) -> bytes:
        if self.local:
            return Path(self.path(name)).read_bytes()
        with self.fs.open(self.path(name), "rb") as f:
            return f.read()

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name))

    # ------------------------------------------------------------ writing

    def makedirs(self) -> None:
        if self.local:
            os.makedirs(self.root, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)

    def staging(self) -> str:
        """The local directory where ``.part`` files are built: the directory itself when local."""
        if self.local:
            return self.root
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="steerable-staging-")
        return self._staging

    def new_part(self, stem: str) -> str:
        """A fresh local path for a file in the making (its name says what it will become)."""
        return os.path.join(self.staging(), f".{stem}.{uuid.uuid4().hex[:12]}.part")

    def stage(self, part: str) -> str:
        """Hand a finished local ``.part`` file over to the directory; returns its name there,
        which ``commit`` renames into place (an upload for a URL)."""
        name = os.path.basename(part)
        if not self.local:
            self.fs.put_file(part, self.path(name))
            os.unlink(part)
        return name

    def commit(self, part_name: str, name: str) -> None:
        """Rename a staged part into place (atomic on a local file system)."""
        if self.local:
            os.replace(self.path(part_name), self.path(name))
        else:
            self.fs.mv(self.path(part_name), self.path(name))

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole or not at all."""
        part = self.new_part(name)
        try:
            with open(part, "wb") as f:
                f.write(data)
            self.commit(self.stage(part), name)
        except BaseException:
            if os.path.exists(part):
                os.unlink(part)
            raise

    def write_json(self, name: str, value: Any, **dump_kwargs: Any) -> None:
        self.write_bytes(name, json.dumps(value, **dump_kwargs).encode())

    def remove(self, name: str) -> None:
        where = self.path(name)
        if self.local:
            if os.path.isdir(where):
                shutil.rmtree(where)
            elif os.path.exists(where):
                os.unlink(where)
        elif self.fs.exists(where):
            self.fs.rm(where, recursive=True)

    def remove_parts(self) -> None:
        """Every ``.part`` left by a killed run (here and, for a URL, in local staging)."""
        for name in self.listdir():
            if name.startswith(".") and name.endswith(".part"):
                self.remove(name)
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
