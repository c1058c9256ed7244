"""SAELens' activation cache: what ``ActivationsStore`` reads with ``use_cached_activations=True``
and ``cached_activations_path=DIR``, a Hugging Face ``datasets`` directory saved to disk, written
here with pyarrow alone (the engine does not depend on ``datasets``).

Layout, as ``Dataset.save_to_disk`` (datasets 5) writes it:

- ``data-XXXXX-of-YYYYY.arrow``: Arrow IPC *stream* files, one per shard of windows (at most
  2 GB), schema metadata ``huggingface`` = ``{"info": {"features": ...}}``;
- one column per captured layer, named by its TransformerLens hook (``blocks.L.hook_resid_pre`` /
  ``hook_resid_mid`` / ``hook_resid_post``), feature ``Array2D(shape=(N, d_model), dtype)``: Arrow
  storage ``list<list<float>>``, the field tagged with datasets' extension type name and its
  ``[[N, d_model], dtype]`` metadata, so ``datasets`` rebuilds the ``Array2D`` type;
- ``token_ids``: ``Sequence(Value("int32"), length=N)`` (``fixed_size_list<int32>[N]``);
- ``dataset_info.json`` (the features) and ``state.json`` (the file list, a fingerprint), written
  last: until they exist the directory is not a dataset, so an unfinished run is never mistaken
  for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from steerable.capture.output_dir import OutputDir
from steerable.capture.shard_stores import FILES_AHEAD, Commit, Job, ShardTask
from steerable.errors import InvalidRequestError
from steerable.hook_points import transformer_lens_name

STORED_DTYPES = {"float32": torch.float32, "float16": torch.float16}
ARRAY2D = "datasets.features.features.Array2DExtensionType"
MAX_FILE_BYTES = 2 * 10**9  # the bound, also what keeps list offsets in int32
DEFAULT_FILE_BYTES = 500 * 10**6  # datasets' own default max_shard_size
WRITE_BATCH_BYTES = 64 * 2**20  # record batches within a file (datasets also writes several)


def stored_dtype(dtype: str | None, model_dtype: torch.dtype) -> str:
    """float32 or float16 (Arrow has no bfloat16); by default the model's if it is one of them,
    else float32, which holds bfloat16 values exactly."""
    if dtype is None:
        return {torch.float16: "float16"}.get(model_dtype, "float32")
    name = str(dtype).removeprefix("torch.")
    if name in ("bfloat16", "bf16"):
        raise InvalidRequestError("dtype: the saelens format cannot store bfloat16 (Arrow has no bfloat16 type); "
                                  "use float16 (--capture-dtype float16; half the size, enough for most residual streams) "
                                  "or float32")
    if name not in STORED_DTYPES:
        raise InvalidRequestError(f"dtype: the saelens format stores float32 or float16, got {dtype!r}")
    return name


def features(columns: list[str], context_size: int, width: int, dtype: str) -> dict[str, Any]:
    """datasets' JSON form of the features (``token_ids`` as ``Sequence``, read by datasets 2 to 5)."""
    out: dict[str, Any] = {c: {"shape": [context_size, width], "dtype": dtype, "_type": "Array2D"} for c in columns}
    out["token_ids"] = {"feature": {"dtype": "int32", "_type": "Value"}, "length": context_size, "_type": "Sequence"}
    return out


def window_bytes(num_layers: int, context_size: int, width: int, dtype: str) -> int:
    return context_size * (num_layers * width * STORED_DTYPES[dtype].itemsize + 4)


def arrow_schema(columns: list[str], context_size: int, width: int, dtype: str) -> Any:
    import pyarrow as pa

    value = {"float32": pa.float32(), "float16": pa.float16()}[dtype]
    tag = {"ARROW:extension:name": ARRAY2D, "ARROW:extension:metadata": json.dumps([[context_size, width], dtype])}
    fields = [pa.field(c, pa.list_(pa.list_(value)), metadata=tag) for c in columns]
    fields.append(pa.field("token_ids", pa.list_(pa.int32(), context_size)))
    info = {"info": {"features": features(columns, context_size, width, dtype)}}
    return pa.schema(fields, metadata={"huggingface": json.dumps(info)})


def write_arrow_file(path: str, schema: Any, data: torch.Tensor, tokens: np.ndarray) -> None:
    """One data file: ``data`` ``[layers, windows * N, width]`` (host memory, one column per layer,
    its bytes handed to pyarrow without a copy), ``tokens`` ``int32 [windows, N]``."""
    import pyarrow as pa

    windows, n = tokens.shape
    width = data.shape[2]
    value_type = schema.field(0).type.value_type.value_type
    per_window = n * width * data.element_size() * data.shape[0]
    step = max(1, WRITE_BATCH_BYTES // per_window)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, windows, step):
            hi = min(windows, lo + step)
            inner_offsets = _array(np.arange(0, (hi - lo) * n * width + 1, width, dtype=np.int32), pa.int32())
            outer_offsets = _array(np.arange(0, (hi - lo) * n + 1, n, dtype=np.int32), pa.int32())
            columns = []
            for layer in range(data.shape[0]):
                values = _array(data[layer, lo * n:hi * n].numpy().reshape(-1), value_type)
                columns.append(pa.ListArray.from_arrays(outer_offsets, pa.ListArray.from_arrays(inner_offsets, values)))
            columns.append(pa.FixedSizeListArray.from_arrays(_array(tokens[lo:hi].reshape(-1), pa.int32()), n))
            writer.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))


def _array(values: np.ndarray, arrow_type: Any) -> Any:
    """A pyarrow array over ``values``' own memory (``pa.array`` would also import pandas, a second
    on first use)."""
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(arrow_type, len(values), [None, pa.py_buffer(values)])


def finish_dataset(out: OutputDir, files: list[str], columns: list[str], context_size: int, width: int, dtype: str,
                   identity: dict[str, Any], description: str) -> None:
    """``dataset_info.json`` then ``state.json`` (the commit point), as ``save_to_disk`` writes them.
    The fingerprint (datasets' cache key) is a hash of the run's identity: the same corpus, model
    and settings give the same fingerprint, however many workers wrote the files."""
    info = {"citation": "", "description": description, "features": features(columns, context_size, width, dtype),
            "homepage": "", "license": ""}
    out.write_json("dataset_info.json", info, indent=2)
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    state = {"_data_files": [{"filename": name} for name in files], "_fingerprint": fingerprint,
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": None}
    out.write_json("state.json", state, indent=2, sort_keys=True)


class ArrowShards:
    """Shard storage of the saelens format. A shard's rows land in a host buffer ``[layers, rows,
    width]`` (made ahead in the background and reused from shard to shard, so its pages are
    faulted in once, off the engine's and the sink's threads); once complete, one
    background thread writes it as an Arrow file under a ``.part`` name, checks that every row
    holds the token it should, stages it and calls ``commit``, while the engine captures the next
    shards. When writes fall behind, ``prepare`` waits for one (the engine then waits for the disk)."""

    MAX_BUFFERS = FILES_AHEAD + 3

    def __init__(self, out: OutputDir, spec: Any, width: int, commit: Commit, timings: dict[str, float]):
        self.out, self.spec, self.width, self.commit, self.timings = out, spec, width, commit, timings
        self.dtype = STORED_DTYPES[spec.dtype]
        columns = [transformer_lens_name(layer, spec.hook) for layer in spec.layers]
        self.schema = arrow_schema(columns, spec.context_size, width, spec.dtype)
        self.pending: deque[tuple[Job, Future]] = deque()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="saelens-writer")
        self.buffers = ThreadPoolExecutor(1, thread_name_prefix="saelens-buffers")
        self.writes: deque[Future] = deque()
        self.free: list[torch.Tensor] = []
        self.in_use = 0
        self.lock = threading.Lock()
        self.parts: set[str] = set()
        self.done = Future()
        self.done.set_result(None)

    def prepare(self, task: ShardTask, counts: list[int]) -> None:
        rows = sum(counts)
        if rows != len(task.prompts) * self.spec.context_size:
            raise RuntimeError("saelens shards hold every position of every window")
        self._settle(block=self.in_use >= self.MAX_BUFFERS)
        with self.lock:
            self.in_use += 1
        self.pending.append((Job(task, counts), self.buffers.submit(self._buffer, rows)))

    def take(self) -> tuple[Job, Future]:
        """The oldest shard prepared, its buffer ready (allocated and touched in the background)."""
        job, buffer = self.pending.popleft()
        data = buffer.result()
        job.file = SimpleNamespace(data=data, labels=np.empty((3, data.shape[1]), np.int64), wait_rows=None)
        job.extra.update(data=data, labels=job.file.labels)
        return job, self.done

    def finish(self, job: Job, allocation: Future, entry: dict[str, Any]) -> None:
        self.writes.append(self.writer.submit(self._write, job, entry))
        self._settle(block=False)

    def _buffer(self, rows: int) -> torch.Tensor:
        """A free buffer of that size, or a new one whose pages are touched here (a page fault
        each, which on the capture's sink thread would hold the engine up)."""
        with self.lock:
            for i, buf in enumerate(self.free):
                if buf.shape[1] == rows:
                    return self.free.pop(i)
        return torch.zeros(len(self.spec.layers), rows, self.width, dtype=self.dtype)

    def _settle(self, block: bool) -> None:
        """Raise a failed write; with ``block``, wait for the oldest write in flight (if any)."""
        while self.writes and (self.writes[0].done() or block):
            self.writes.popleft().result()
            block = False

    def _write(self, job: Job, entry: dict[str, Any]) -> None:
        started = time.perf_counter()
        data, labels = job.extra["data"], job.extra["labels"]
        tokens = np.asarray(job.task.prompts, dtype=np.int32)
        if not np.array_equal(labels[2], tokens.reshape(-1)) or not np.array_equal(
                labels[1], np.tile(np.arange(tokens.shape[1]), len(tokens))):
            raise RuntimeError(f"saelens shard {job.task.shard}: rows out of place (token ids or positions differ "
                               "from the windows)")
        part = self.out.new_part(entry["file"])
        self.parts.add(part)
        write_arrow_file(part, self.schema, data, tokens)
        wrote = time.perf_counter()
        name = self.out.stage(part)
        self.parts.discard(part)
        self.commit(entry, name)
        with self.lock:
            self.in_use -= 1
            self.free.append(data)
        self.timings["write_seconds"] = self.timings.get("write_seconds", 0.0) + wrote - started
        self.timings["commit_seconds"] = self.timings.get("commit_seconds", 0.0) + time.perf_counter() - wrote

    def __enter__(self) -> "ArrowShards":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            while self.writes:
                future = self.writes.popleft()
                if exc_type is None:
                    future.result()  # the first failed write is raised
                else:
                    with contextlib.suppress(Exception):
                        future.result()
        finally:
            self.buffers.shutdown(wait=True)
            self.writer.shutdown(wait=True)
            for part in self.parts:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
