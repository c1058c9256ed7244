"""Corpus capture: a list of texts -> labelled activations in sharded safetensors, resumable.

``OUT/shard-00000.safetensors`` holds examples ``[0, shard_size)``, the next shard the next
``shard_size`` and so on; in each, ``layer.L`` is ``Tensor[rows, width]`` at layer L and the label
tensors ``example`` (index into the corpus), ``position`` and ``token_id`` (int64) say what each row
is. ``OUT/index.json`` records the settings (model, layers, hook, select, dtype, shard size, corpus
hash) and every finished shard with its example range and row count. A shard is written to a temp
file and renamed, then listed in the index (itself replaced atomically), so a run killed at any
point resumes (``resume=True``) by recomputing only the shards the index does not list; the result
is the same as an uninterrupted run.

Speed: the rows go through a capture stream whose sink is the shard itself (``ShardBuffer``), so
each row is copied once, from the step's host block to its place in the shard, and the file is
written from that memory (``write_safetensors``) by a background thread while the next shard is
captured into a second buffer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from steerable.capture.shard_buffer import ShardBuffer
from steerable.capture.shard_file import write_safetensors
from steerable.capture.store import resolve_storage_dtype
from steerable.entrypoints.llm import run_to_completion
from steerable.errors import InvalidRequestError
from steerable.hook_points import HIDDEN_STATES, POST_MLP, RESIDUAL_POINTS
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

FORMAT = "steerable-corpus-v1"
INDEX = "index.json"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def capture_corpus(llm: Any, texts: Sequence[str | list[int]], out: str | os.PathLike,
                   layers: Sequence[int] | None = None, hook: str = POST_MLP, select: Any = "last_prompt",
                   dtype: str | None = None, shard_size: int = 1000, batch_size: int = 64, resume: bool = False,
                   model: str | None = None, use_tqdm: bool = False) -> dict[str, Any]:
    """Capture ``hook`` at ``layers`` (default: all) on the rows ``select`` picks, for every text,
    into shards under ``out``; returns the index. ``resume=True`` continues a run with the same
    settings (anything else differing fails naming it); without it, ``out`` must hold no capture.
    Holds two shards' rows in memory; records through the ``hidden_states`` stream, which must not
    be running."""
    engine = llm.llm_engine
    cfg = engine.model_config
    settings = _settings(texts, cfg.num_layers, layers, hook, select, dtype, shard_size, batch_size,
                         model or engine.config.model)
    if engine.capture_status(HIDDEN_STATES)["enabled"]:
        raise InvalidRequestError("capture_corpus: the hidden_states capture stream is running; stop it first "
                                  "(corpus capture records through that stream)")
    out = Path(out)
    index = _open_index(out, settings, resume)
    done = {entry["shard"] for entry in index["shards"] if (out / entry["file"]).exists()}
    index["shards"] = [entry for entry in index["shards"] if entry["shard"] in done]
    todo = [k for k in range(-(-len(texts) // shard_size)) if k not in done]
    finished = sum(entry["stop"] - entry["start"] for entry in index["shards"])
    storage = resolve_storage_dtype(dtype) or engine.dtype
    buffers = [ShardBuffer(len(settings["layers"]), cfg.hidden_size, storage) for _ in range(min(2, len(todo)))]
    with tqdm(total=len(texts), initial=finished, desc="Capturing", unit="example", disable=not use_tqdm) as bar, \
            _ShardWriter(out, index, bar) as writer:
        for i, k in enumerate(todo):
            lo, hi = k * shard_size, min((k + 1) * shard_size, len(texts))
            buffer = buffers[i % 2]  # the other one may still be being written
            _capture_shard(engine, texts, lo, hi, settings, batch_size, buffer, bar, writer)
            writer.submit({"shard": k, "file": shard_name(k), "start": lo, "stop": hi, "rows": buffer.rows},
                          buffer.tensors(settings["layers"]))
    index["complete"] = True
    _write_index(out, index)
    return index


def _settings(texts: Sequence[Any], num_layers: int, layers: Sequence[int] | None, hook: str, select: Any,
              dtype: str | None, shard_size: int, batch_size: int, model: str) -> dict[str, Any]:
    """Every argument checked before any work; the settings a resumed run must match."""
    if isinstance(texts, str) or not texts:
        raise InvalidRequestError("texts: expected a non-empty list of prompts")
    layer_list = list(range(num_layers)) if layers is None else sorted(set(layers))
    bad = [layer for layer in layer_list if not isinstance(layer, int) or not 0 <= layer < num_layers]
    if bad or not layer_list:
        raise InvalidRequestError(f"layers: {bad or 'none'} not layer indices in [0, {num_layers})")
    if hook not in RESIDUAL_POINTS:
        raise InvalidRequestError(f"hook: unknown hook {hook!r}; expected one of {list(RESIDUAL_POINTS)}")
    resolve_storage_dtype(dtype, "dtype")
    for name, value in (("shard_size", shard_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidRequestError(f"{name}: must be an integer >= 1, got {value!r}")
    digest = hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()
    return {"format": FORMAT, "model": model, "layers": layer_list, "hook": hook,
            "select": SelectSpec.parse(select).to_wire(), "dtype": dtype, "shard_size": shard_size,
            "num_examples": len(texts), "corpus_sha256": digest}


def _open_index(out: Path, settings: dict[str, Any], resume: bool) -> dict[str, Any]:
    path = out / INDEX
    if path.exists():
        if not resume:
            raise InvalidRequestError(f"out: {out} already holds a corpus capture; resume it (--resume) or choose "
                                      "another directory")
        index = json.loads(path.read_text())
        for key, value in settings.items():
            if index.get(key) != value:
                raise InvalidRequestError(f"resume: {key} differs from the interrupted run ({index.get(key)!r} there, "
                                          f"{value!r} now)")
        for stale in out.glob(".shard-*.part"):  # a shard being written when the run was killed
            stale.unlink()
        return index
    out.mkdir(parents=True, exist_ok=True)
    index = {**settings, "complete": False, "shards": []}
    _write_index(out, index)
    return index


def _capture_shard(engine: Any, texts: Sequence[Any], lo: int, hi: int, settings: dict[str, Any], batch_size: int,
                   buffer: ShardBuffer, bar: tqdm, writer: "_ShardWriter") -> None:
    """Fill ``buffer`` with the rows of every example in [lo, hi)."""
    select = SelectSpec.from_wire(settings["select"])
    prompts = [engine.tokenize(text) for text in texts[lo:hi]]
    buffer.reset(lo, [len(select.prompt_positions_selected(prompt)) for prompt in prompts])
    engine.start_capture(HIDDEN_STATES, settings["layers"], settings["dtype"], "all", select, None, settings["hook"],
                         sink=buffer)
    try:
        for start in range(0, hi - lo, batch_size):
            batch = prompts[start:start + batch_size]
            _prefill(engine, batch, lo + start, buffer)
            bar.update(len(batch))
            writer.check()
    finally:
        engine.stop_capture(HIDDEN_STATES)
    buffer.check_complete()


def _prefill(engine: Any, prompts: list[list[int]], first: int, buffer: ShardBuffer) -> None:
    """Run examples ``first, first + 1, ...`` to their first token (never fed back: only prompt rows
    are computed), as ``LLM.generate`` does, telling ``buffer`` which engine request is which."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    added: list[str] = []
    try:
        for i, prompt in enumerate(prompts):
            group = engine.add_request(f"corpus-{first + i}", prompt, params)
            added.append(group.client_id)
            buffer.expect(group.children[0].request_id, first + i)
    except BaseException:
        engine.abort_request(added)
        raise
    run_to_completion(engine, added)


class _ShardWriter:
    """Writes one shard at a time in a background thread (file writes release the GIL), so a shard's
    file is written while the next one is captured. A shard is listed in the index (by the calling
    thread) only once its file is in place; a failed write is raised in the caller at the next
    ``check``, ``submit`` or exit. On exit every write has ended: one in flight when the caller
    failed is still listed if it succeeded (a resumed run then skips it)."""

    def __init__(self, out: Path, index: dict[str, Any], bar: tqdm):
        self.out, self.index, self.bar = out, index, bar
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="corpus-writer")
        self.pending: tuple[Future, dict[str, Any]] | None = None
        self.start_time, self.rows_written = time.perf_counter(), 0

    def submit(self, entry: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        self.wait()
        write = lambda path: write_safetensors(path, tensors, metadata={"format": FORMAT})  # noqa: E731
        self.pending = (self.pool.submit(_write_atomic, self.out / entry["file"], write), entry)

    def check(self) -> None:
        """Raise a failed write's error now rather than after the next shard."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Let the write in flight finish and list its shard."""
        if self.pending is None:
            return
        (future, entry), self.pending = self.pending, None
        future.result()
        self.index["shards"].append(entry)
        self.index["shards"].sort(key=lambda e: e["shard"])
        _write_index(self.out, self.index)
        self.rows_written += entry["rows"]
        self.bar.set_postfix(rows_per_s=f"{self.rows_written / (time.perf_counter() - self.start_time):.0f}")

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is None:
                self.wait()
            else:
                with contextlib.suppress(Exception):  # the caller's own error is the one raised
                    self.wait()
        finally:
            self.pool.shutdown(wait=True)


def _write_index(out: Path, index: dict[str, Any]) -> None:
    _write_atomic(out / INDEX, lambda path: Path(path).write_text(json.dumps(index, indent=1)))


def _write_atomic(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename over ``path``: a reader (or a resumed run) never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=".shard-", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
