"""Corpus capture: a list of texts -> labelled activations in sharded safetensors, resumable.

``OUT/shard-00000.safetensors`` holds examples ``[0, shard_size)``, the next shard the next
``shard_size`` and so on; in each, ``layer.L`` is ``Tensor[rows, width]`` at layer L and the label
tensors ``example`` (index into the corpus), ``position`` and ``token_id`` (int64) say what each row
is. With an SAE (``sae=``: a registered name) a shard holds its features instead: ``indices``
(int32) and ``values`` (float32), both ``[rows, top_k]`` (``SparseFeatures``), and the same labels.
``OUT/index.json`` records the settings (model, layers, hook, select, dtype, shard size, corpus
hash) and every finished shard with its example range and row count. A shard is written to a temp
file and renamed, then listed in the index (itself replaced atomically), so a run killed at any
point resumes (``resume=True``) by recomputing only the shards the index does not list; the result
is the same as an uninterrupted run.

Speed: the rows go through one capture stream whose sink places them in the shard files
themselves (``ShardRouter`` -> ``ShardBuffer`` over a ``ShardFile``'s mapped pages), so each row
is copied once, from the step's host block to its place in the file, on the capture session's
sink thread while the engine runs the next steps, and nothing is written afterwards. The engine
gets the examples without a pause between shards; the next shards' files are created and their
space reserved by background threads while earlier ones are captured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from steerable.capture.features import SAE_FEATURES
from steerable.capture.shard_buffer import ShardBuffer, ShardRouter
from steerable.capture.shard_file import ShardFile
from steerable.capture.sparse import SparseFeatures
from steerable.capture.store import StreamRows, resolve_storage_dtype
from steerable.errors import InvalidRequestError
from steerable.hook_points import HIDDEN_STATES, POST_MLP, check_hook_point
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

FORMAT = "steerable-corpus-v1"
INDEX = "index.json"
# Shard files allocated ahead, each by its own thread: allocating a file (a kernel memset of its
# pages) takes about as long as capturing into it, so one thread alone would fall behind.
FILES_AHEAD = 2


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def capture_corpus(llm: Any, texts: Sequence[str | list[int]], out: str | os.PathLike,
                   layers: Sequence[int] | None = None, hook: str = POST_MLP, select: Any = "last_prompt",
                   dtype: str | None = None, shard_size: int = 1000, batch_size: int = 64, resume: bool = False,
                   model: str | None = None, use_tqdm: bool = False, sae: str | None = None,
                   top_k: int = 64) -> dict[str, Any]:
    """Capture ``hook`` at ``layers`` (default: all) on the rows ``select`` picks, for every text,
    into shards under ``out``; returns the index. ``resume=True`` continues a run with the same
    settings (anything else differing fails naming it); without it, ``out`` must hold no capture.
    ``batch_size`` texts are in the engine at a time; a few shard files are mapped at a time;
    records through the ``hidden_states`` stream, which must not be running. ``sae``: store the
    ``top_k`` highest features of that registered SAE (at its own point; ``layers``, ``hook`` and
    ``dtype`` do not apply), through the ``sae_features`` stream."""
    engine = llm.llm_engine
    cfg = engine.model_config
    if sae is not None:
        (_, _, found), = engine.capture.features.resolve([sae], top_k, "")
        layers, hook, dtype = list(getattr(found, "layers", [found.layer])), found.hook, None
    settings = _settings(texts, cfg.num_layers, layers, hook, select, dtype, shard_size, batch_size,
                         model or engine.config.model)
    if sae is not None:
        settings.update(sae=sae, sae_sha256=found.content_hash.hex(), top_k=top_k)
    stream = HIDDEN_STATES if sae is None else SAE_FEATURES
    if engine.capture_status(stream)["enabled"]:
        raise InvalidRequestError(f"capture_corpus: the {stream} capture stream is running; stop it first "
                                  "(corpus capture records through that stream)")
    out = Path(out)
    index = _open_index(out, settings, resume)
    done = {entry["shard"] for entry in index["shards"] if (out / entry["file"]).exists()}
    index["shards"] = [entry for entry in index["shards"] if entry["shard"] in done]
    todo = [k for k in range(-(-len(texts) // shard_size)) if k not in done]
    finished = sum(entry["stop"] - entry["start"] for entry in index["shards"])
    if sae is None:
        shape = dict(layers=settings["layers"], width=cfg.hidden_size, dtype=resolve_storage_dtype(dtype) or engine.dtype)
    else:  # the staged rows' float32 [indices bits | values] halves as two tensors of the file
        shape = dict(layers=[0, 1], width=top_k, dtype=torch.float32, names=[("indices", "I32"), ("values", "F32")])
    with tqdm(total=len(texts), initial=finished, desc="Capturing", unit="example", disable=not use_tqdm) as bar, \
            _ShardFiles(out, index, bar=bar, **shape) as files:
        _CorpusRun(engine, texts, settings, batch_size, files, bar).run(todo)
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
    check_hook_point(hook, "hook")
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
        for stale in [*out.glob(".shard-*.part"), *out.glob(".index-*.part")]:  # left by a killed run
            stale.unlink()
        return index
    out.mkdir(parents=True, exist_ok=True)
    index = {**settings, "complete": False, "shards": []}
    _write_index(out, index)
    return index


@dataclass
class _Job:
    shard: int
    prompts: list[list[int]]
    counts: list[int]  # selected rows per example
    part: Path  # the file while it is filled
    file: ShardFile | None = None


@dataclass
class _OpenShard:
    job: _Job
    allocation: Future
    buffer: ShardBuffer
    unfinished: int  # its requests still in the engine or not yet added


class _CorpusRun:
    """The engine loop of one ``capture_corpus`` call. Examples go to the engine in order, at most
    ``batch_size`` at a time, shard after shard without a pause, through one capture stream whose
    sink (``ShardRouter``) takes each request's rows to its shard on the sink thread. A shard is
    finished (renamed, listed) once its requests are done and all its rows are stored, while the
    next ones are captured. Each request runs to its first token, which is never fed back: only
    prompt rows are computed."""

    PARAMS = SamplingParams(max_tokens=1, temperature=0.0)

    def __init__(self, engine: Any, texts: Sequence[Any], settings: dict[str, Any], batch_size: int,
                 files: "_ShardFiles", bar: tqdm):
        self.engine, self.texts, self.settings, self.batch_size = engine, texts, settings, batch_size
        self.files, self.bar = files, bar
        self.select = SelectSpec.from_wire(settings["select"])
        self.router = ShardRouter()
        self.open: deque[_OpenShard] = deque()  # oldest first
        self.in_engine: dict[str, _OpenShard] = {}  # client id -> its shard

    def run(self, todo: list[int]) -> None:
        upcoming = iter(todo)
        for _ in range(FILES_AHEAD):
            self._prepare(next(upcoming, None))
        feed = self._examples(len(todo), upcoming)
        engine = self.engine
        sae = self.settings.get("sae")
        stream = HIDDEN_STATES if sae is None else SAE_FEATURES
        if sae is None:
            engine.start_capture(HIDDEN_STATES, self.settings["layers"], self.settings["dtype"], "all", self.select,
                                 None, self.settings["hook"], sink=self.router)
        else:
            engine.start_capture(SAE_FEATURES, None, None, "all", self.select, None, self.settings["hook"],
                                 sink=_SplitFeatures(self.router), saes=[sae], top_k=self.settings["top_k"])
        try:
            try:
                while True:
                    while len(self.in_engine) < self.batch_size and self._add(next(feed, None)):
                        pass
                    if not self.in_engine:
                        break
                    for out in engine.step():
                        if out.finished and out.request_id in self.in_engine:
                            self.in_engine.pop(out.request_id).unfinished -= 1
                            self.bar.update(1)
                    self._finish_ready()
                engine.finish_inflight()  # its rows belong to finished requests: delivered nowhere
            except BaseException:
                engine.abort_request(list(self.in_engine))
                raise
        finally:
            engine.stop_capture(stream)  # returns once the sink thread has stored every row
        self._finish_ready()
        for shard in self.open:  # every request is done and every row delivered
            shard.buffer.check_complete()

    def _prepare(self, k: int | None) -> None:
        if k is not None:
            shard_size = self.settings["shard_size"]
            prompts = [self.engine.tokenize(text) for text in self.texts[k * shard_size:(k + 1) * shard_size]]
            self.files.prepare(k, prompts, [len(self.select.prompt_positions_selected(p)) for p in prompts])

    def _examples(self, shards: int, upcoming: Any) -> Any:
        """(shard, example index, prompt) in corpus order, opening each shard as its turn comes."""
        for _ in range(shards):
            job, allocation = self.files.take()
            self._prepare(next(upcoming, None))  # allocated while earlier shards are captured
            lo = job.shard * self.settings["shard_size"]
            buffer = ShardBuffer(lo, job.counts, job.file.data, job.file.labels, job.file.wait_rows)
            job.file = None  # the mapping goes with the buffer
            shard = _OpenShard(job, allocation, buffer, len(job.prompts))
            self.open.append(shard)
            for i, prompt in enumerate(job.prompts):
                yield shard, lo + i, prompt

    def _add(self, item: tuple[_OpenShard, int, list[int]] | None) -> bool:
        if item is None:
            return False
        shard, example, prompt = item
        group = self.engine.add_request(f"corpus-{example}", prompt, self.PARAMS)
        self.in_engine[group.client_id] = shard
        self.router.expect(group.children[0].request_id, shard.buffer, example)
        return True

    def _finish_ready(self) -> None:
        """Finish the oldest shards that are complete, then raise a later shard's storage failure:
        the shards before it are whole and a resumed run starts after them."""
        while self.open and self.open[0].unfinished == 0 and self.open[0].buffer.complete:
            shard = self.open.popleft()
            self.router.forget(shard.buffer)
            k, lo = shard.job.shard, shard.buffer.first
            self.files.finish(shard.job, shard.allocation, {"shard": k, "file": shard_name(k), "start": lo,
                                                            "stop": lo + len(shard.job.prompts),
                                                            "rows": shard.buffer.rows})
        for shard in self.open:
            shard.buffer.check()


class _SplitFeatures:
    """A sink that hands the router a step's feature rows ``[1, rows, 2 * top_k]`` as the two
    tensors of a shard, ``[indices bits, values]`` (``[2, rows, top_k]``, a view). A transcoder of
    several layers stages ``[layers, rows, 2 * top_k]``: each row's highest over all of them."""

    threaded = True

    def __init__(self, router: ShardRouter):
        self.router = router

    def append(self, rows: StreamRows) -> None:
        block = rows.block[0]
        if rows.block.shape[0] > 1:
            merged = SparseFeatures.unpack_layers(rows.block)
            block = torch.cat([merged.indices.view(torch.float32), merged.values], dim=1)
        split = block.view(block.shape[0], 2, block.shape[1] // 2).permute(1, 0, 2)
        self.router.append(StreamRows(split, rows.where, rows.request_ids, rows.counts, rows.positions,
                                      rows.token_ids))


class _ShardFiles:
    """Shard files in the making: ``prepare`` creates the next one (a ``.part`` file) and reserves
    its space in a background thread, ``take`` hands out the oldest, ``finish`` renames a filled
    one into place and only then lists it in the index, so the index (and a resumed run) never
    sees half a shard. On exit every allocation has ended and the ``.part`` files not finished
    are removed. A failed allocation is raised where the capture waits for its rows."""

    def __init__(self, out: Path, index: dict[str, Any], layers: list[int], width: int, dtype: torch.dtype,
                 bar: tqdm, names: list[tuple[str, str]] | None = None):
        self.out, self.index, self.layers, self.width, self.dtype, self.bar = out, index, layers, width, dtype, bar
        self.names = names
        self.pool = ThreadPoolExecutor(FILES_AHEAD, thread_name_prefix="corpus-files")
        self.pending: deque[tuple[_Job, Future]] = deque()
        self.parts: set[Path] = set()  # created, not yet renamed
        self.start_time, self.rows_written = time.perf_counter(), 0

    def prepare(self, shard: int, prompts: list[list[int]], counts: list[int]) -> None:
        fd, name = tempfile.mkstemp(prefix=".shard-", suffix=".part", dir=self.out)
        os.close(fd)
        job = _Job(shard, prompts, counts, Path(name))
        self.parts.add(job.part)
        job.file = ShardFile(job.part, self.layers, sum(counts), self.width, self.dtype, {"format": FORMAT},
                             self.names)
        self.pending.append((job, self.pool.submit(job.file.allocate)))

    def take(self) -> tuple[_Job, Future]:
        """The oldest shard prepared, and its allocation (writers wait on the file for their rows)."""
        return self.pending.popleft()

    def finish(self, job: _Job, allocation: Future, entry: dict[str, Any]) -> None:
        allocation.result()  # done by now (every row was written); raises if it failed
        os.replace(job.part, self.out / entry["file"])
        self.parts.discard(job.part)
        self.index["shards"].append(entry)
        self.index["shards"].sort(key=lambda e: e["shard"])
        _write_index(self.out, self.index)
        self.rows_written += entry["rows"]
        self.bar.set_postfix(rows_per_s=f"{self.rows_written / (time.perf_counter() - self.start_time):.0f}")

    def __enter__(self) -> "_ShardFiles":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            for _, future in self.pending:
                with contextlib.suppress(Exception):  # the caller's own error is the one raised
                    future.result()
        finally:
            self.pool.shutdown(wait=True)
            for part in self.parts:
                part.unlink(missing_ok=True)


def _write_index(out: Path, index: dict[str, Any]) -> None:
    """Replaced atomically: a reader (or a resumed run) never sees half an index."""
    fd, tmp = tempfile.mkstemp(prefix=".index-", suffix=".part", dir=out)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(index, indent=1))
        os.replace(tmp, out / INDEX)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
