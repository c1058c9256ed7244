"""Files the engine writes for others to read (corpus shards and their index, capture consumers'
shards, control vectors): each is filled under a temporary name beside its own and renamed into
place, with the permissions the umask gives any file of the process, so the other users of a
shared directory (a cluster's) can read them. And the JSON-lines files users hand it (corpora,
contrast pairs, batch requests), read with errors that name the file and line."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from steerable.errors import InvalidRequestError


def create_part(directory: str | os.PathLike, prefix: str) -> Path:
    """A new empty ``prefix*.part`` file in ``directory``, named uniquely (``tempfile.mkstemp``
    would make it 0600 whatever the umask)."""
    while True:
        path = Path(directory) / f"{prefix}{secrets.token_hex(8)}.part"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:
            continue


def write_safetensors(tensors: dict[str, Any], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, keeping the permissions a new file gets from the umask
    (or the existing file's): ``save_file`` itself leaves 0600."""
    from safetensors.torch import save_file

    with open(path, "ab"):
        pass
    mode = os.stat(path).st_mode & 0o777
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, mode)


def read_jsonl(path: str | os.PathLike) -> list[Any]:
    """Every non-empty line parsed as JSON; a bad line fails naming the file and line number."""
    if not os.path.isfile(path):
        raise InvalidRequestError(f"{path}: no such file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise InvalidRequestError(f"{path}:{number}: not JSON ({err})") from None
    return records
