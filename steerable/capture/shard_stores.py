"""Where a corpus run's shards are filled: ``SafetensorsShards`` (steerable's own shards, filled in
place through mapped pages); ``formats.saelens.ArrowShards`` keeps the same interface.

A store is driven by the engine loop (``corpus_run.CorpusRun``): ``prepare`` sets up the next
shard ahead of time, ``take`` hands out the oldest prepared one (an object with ``data``
``[layers, rows, width]``, ``labels`` ``[3, rows]`` and ``wait_rows``, which ``ShardBuffer``
fills), ``finish`` completes a filled shard under a temporary ``.part`` name, stages it into the
output directory and calls ``commit(entry, part_name)``, which renames it into place and lists it
(in this process, or in the driver of replicas). On exit nothing of an unfinished shard remains.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from steerable.capture.output_dir import OutputDir
from steerable.capture.shard_file import ShardFile

# Shard files allocated ahead, each by its own thread: allocating a file (a kernel memset of its
# pages) takes about as long as capturing into it, so one thread alone would fall behind.
FILES_AHEAD = 2

Commit = Callable[[dict[str, Any], str], None]  # (index entry, staged part name)


@dataclass
class ShardTask:
    """One shard of a run: corpus examples ``[first, first + len(prompts))`` as token ids."""

    shard: int
    first: int
    prompts: Sequence[Sequence[int]]


@dataclass
class Job:
    task: ShardTask
    counts: list[int]  # selected rows per example
    part: str = ""  # the local file while it is filled
    file: Any = None  # what the rows are copied into (data, labels, wait_rows)
    extra: dict[str, Any] = field(default_factory=dict)


class SafetensorsShards:
    """Safetensors shard files in the making: ``prepare`` creates the next one (a ``.part`` file)
    and reserves its space in a background thread; ``finish`` stages a filled one for ``commit``.
    A failed allocation is raised where the capture waits for its rows. ``names``: see
    ``ShardFile`` (SAE features store ``indices`` and ``values``)."""

    def __init__(self, out: OutputDir, file_name: Callable[[int], str], commit: Commit, layers: list[int], width: int,
                 dtype: torch.dtype, metadata: dict[str, str], names: list[tuple[str, str]] | None = None):
        self.out, self.file_name, self.commit = out, file_name, commit
        self.layers, self.width, self.dtype, self.metadata, self.names = layers, width, dtype, metadata, names
        self.pool = ThreadPoolExecutor(FILES_AHEAD, thread_name_prefix="corpus-files")
        self.pending: deque[tuple[Job, Future]] = deque()
        self.parts: set[str] = set()  # created, not yet staged

    def prepare(self, task: ShardTask, counts: list[int]) -> None:
        job = Job(task, counts, self.out.new_part(self.file_name(task.shard)))
        self.parts.add(job.part)
        job.file = ShardFile(job.part, self.layers, sum(counts), self.width, self.dtype, self.metadata, self.names)
        self.pending.append((job, self.pool.submit(job.file.allocate)))

    def take(self) -> tuple[Job, Future]:
        """The oldest shard prepared, and its allocation (writers wait on the file for their rows)."""
        return self.pending.popleft()

    def finish(self, job: Job, allocation: Future, entry: dict[str, Any]) -> None:
        allocation.result()  # done by now (every row was written); raises if it failed
        name = self.out.stage(job.part)
        self.parts.discard(job.part)
        self.commit(entry, name)

    def __enter__(self) -> "SafetensorsShards":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for _, future in self.pending:
                with contextlib.suppress(Exception):  # the caller's own error is the one raised
                    future.result()
        finally:
            self.pool.shutdown(wait=True)
            for part in self.parts:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)

