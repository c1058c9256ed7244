"""The engine loop of a corpus capture: shards of examples in, complete shard files out.

One process (``capture_corpus``), each replica process and each Ray actor run this same loop on
their own engine, over the shards they are handed (``ShardTask``: token-id prompts), and hand each
finished shard to ``commit``. Examples go to the engine in order, at most ``batch_size`` at a time,
shard after shard without a pause, through one capture stream whose sink (``ShardRouter``) takes
each request's rows to its shard's place on the capture session's sink thread while the engine
runs the next steps. A shard is finished once its requests are done and all its rows are stored,
while the next ones are captured. Each request runs to its first token, which is never fed back:
only prompt rows are computed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from steerable.capture.features import SAE_FEATURES
from steerable.capture.output_dir import OutputDir
from steerable.capture.shard_buffer import ShardBuffer, ShardRouter
from steerable.capture.shard_stores import (
    FILES_AHEAD,
    Commit,
    Job,
    SafetensorsShards,
    ShardTask,
)
from steerable.capture.sparse import SparseFeatures
from steerable.capture.store import StreamRows, resolve_storage_dtype
from steerable.hook_points import HIDDEN_STATES, layers_needed
from steerable.long_runs import frozen_heap, quick_handoff
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

logger = logging.getLogger(__name__)

STEERABLE, SAELENS, DELPHI = "steerable", "saelens", "delphi"
FORMATS = (STEERABLE, SAELENS, DELPHI)
SHARDS_FORMAT = "steerable-corpus-v1"  # the safetensors shards' ``format`` metadata


@dataclass(frozen=True)
class ShardSpec:
    """What a worker needs to capture shards of a run; plain data, sent to replicas and actors.
    ``out``: the run's directory (path or URL); ``dtype``: the stored dtype (None: the model's)."""

    format: str
    out: str
    layers: tuple[int, ...]
    hook: str
    select: dict[str, Any]
    dtype: str | None
    batch_size: int
    num_shards: int
    sae: str | None = None
    top_k: int = 64
    context_size: int | None = None

    def file_name(self, shard: int) -> str:
        if self.format == SAELENS:
            return f"data-{shard:05d}-of-{self.num_shards:05d}.arrow"
        return f"shard-{shard:05d}.safetensors"

    @property
    def stream(self) -> str:
        return HIDDEN_STATES if self.sae is None else SAE_FEATURES


@dataclass
class RunStats:
    """Where a worker's time went: engine steps, and the shard work done on the engine's thread
    (preparing, handing over, finishing); stores add the time their writes and commits took."""

    step_seconds: float = 0.0
    shard_seconds: float = 0.0
    shards: int = 0
    store: dict[str, float] = field(default_factory=dict)


def open_store(spec: ShardSpec, engine: Any, commit: Commit, stats: RunStats) -> Any:
    out = OutputDir(spec.out)
    if spec.format == SAELENS:
        from steerable.capture.formats.saelens import ArrowShards

        return ArrowShards(out, spec, engine.model_config.hidden_size, commit, stats.store)
    if spec.sae is None:
        dtype = resolve_storage_dtype(spec.dtype) or engine.dtype
        return SafetensorsShards(out, spec.file_name, commit, list(spec.layers), engine.model_config.hidden_size,
                                 dtype, {"format": SHARDS_FORMAT})
    # the staged rows' float32 [indices bits | values] halves as two tensors of the file
    return SafetensorsShards(out, spec.file_name, commit, [0, 1], spec.top_k, torch.float32, {"format": SHARDS_FORMAT},
                             names=[("indices", "I32"), ("values", "F32")])


def capture_shards(engine: Any, spec: ShardSpec, tasks: Iterator[ShardTask], commit: Commit,
                   on_example: Callable[[], None] | None = None) -> RunStats:
    """Capture every shard ``tasks`` yields (the iterator may block until the next one is known;
    ``None`` ends the run) and ``commit`` each one finished; ``on_example`` is called as each
    example leaves the engine. The stream must not be running."""
    stats = RunStats()
    with open_store(spec, engine, commit, stats) as store:
        CorpusRun(engine, spec, store, stats, on_example).run(tasks)
    return stats


@dataclass
class _OpenShard:
    job: Job
    allocation: Future
    buffer: ShardBuffer
    unfinished: int  # its requests still in the engine or not yet added


class CorpusRun:
    PARAMS = SamplingParams(max_tokens=1, temperature=0.0)

    def __init__(self, engine: Any, spec: ShardSpec, store: Any, stats: RunStats,
                 on_example: Callable[[], None] | None):
        self.engine, self.spec, self.store, self.stats, self.on_example = engine, spec, store, stats, on_example
        self.select = SelectSpec.from_wire(spec.select)
        self.router = ShardRouter()
        self.open: deque[_OpenShard] = deque()  # oldest first
        self.in_engine: dict[str, _OpenShard] = {}  # client id -> its shard, while queued or running
        self.queued: list[Any] = []  # the engine's QueuedPrompts of each shard, for their admission errors
        self.stop = stop_layer(engine, spec)

    def run(self, tasks: Iterator[ShardTask]) -> None:
        """Each shard's examples are queued in the engine (admitted as the scheduler has room,
        while the device runs the steps before, as ``LLM.generate`` admits its prompts) once fewer
        than ``batch_size`` examples are queued or running, so the next shard is always there."""
        warning = serial_steps_warning(self.engine, self.spec)
        if warning is not None:
            logger.warning(warning)
        prepared = 0
        for _ in range(FILES_AHEAD):
            prepared += self._prepare(next(tasks, None))
        engine, spec = self.engine, self.spec
        if spec.sae is None:
            engine.start_capture(HIDDEN_STATES, list(spec.layers), spec.dtype, "all", self.select, None, spec.hook,
                                 sink=self.router)
        else:
            engine.start_capture(SAE_FEATURES, None, None, "all", self.select, None, spec.hook,
                                 sink=_SplitFeatures(self.router), saes=[spec.sae], top_k=spec.top_k)
        try:
            with frozen_heap(), quick_handoff(engine.device.type):
                self._loop(tasks, prepared)
        except BaseException:
            with contextlib.suppress(Exception):  # the shards already whole are kept for a resumed run
                self._finish_ready()
            raise
        self._finish_ready()
        for shard in self.open:  # every request is done and every row delivered
            shard.buffer.check_complete()

    def _loop(self, tasks: Iterator[ShardTask], prepared: int) -> None:
        engine, spec = self.engine, self.spec
        try:
            try:
                while True:
                    while prepared and len(self.in_engine) < spec.batch_size:
                        prepared += self._open(next(tasks, None))
                    if not self.in_engine:
                        break
                    started = time.perf_counter()
                    outputs = engine.step()
                    self.stats.step_seconds += time.perf_counter() - started
                    for batch in self.queued:
                        if batch.error is not None:
                            raise batch.error
                    for out in outputs:
                        if out.finished and out.request_id in self.in_engine:
                            self.in_engine.pop(out.request_id).unfinished -= 1
                            if self.on_example is not None:
                                self.on_example()
                    self._finish_ready()
                engine.finish_inflight()  # its rows belong to finished requests: delivered nowhere
            except BaseException:
                engine.abort_request(list(self.in_engine))  # queued ones too
                raise
        finally:
            engine.stop_capture(spec.stream)  # returns once the sink thread has stored every row

    def _prepare(self, task: ShardTask | None) -> int:
        if task is None:
            return 0
        started = time.perf_counter()
        if any(isinstance(p, str) for p in task.prompts):  # texts: tokenized as add_request would
            prompts = [self.engine.tokenize(p) for p in task.prompts]
        else:
            prompts = task.prompts.tolist() if hasattr(task.prompts, "tolist") else [list(p) for p in task.prompts]
        task = ShardTask(task.shard, task.first, prompts)
        select = self.select
        self.store.prepare(task, [len(p) if select.selects_all_from(len(p)) <= 0  # every row: no list to build
                                  else len(select.prompt_positions_selected(p)) for p in prompts])
        self.stats.shard_seconds += time.perf_counter() - started
        return 1

    def _open(self, upcoming: ShardTask | None) -> int:
        """Open the oldest prepared shard and queue its examples, then prepare ``upcoming`` (set up
        while earlier shards are captured); returns the change in prepared shards."""
        job, allocation = self.store.take()
        prepared = self._prepare(upcoming) - 1
        started = time.perf_counter()
        task = job.task
        buffer = ShardBuffer(task.first, job.counts, job.file.data, job.file.labels, job.file.wait_rows)
        job.file = None  # the storage goes with the buffer
        shard = _OpenShard(job, allocation, buffer, len(task.prompts))
        self.open.append(shard)
        requests = []
        for i, prompt in enumerate(task.prompts):
            client_id = f"corpus-{task.first + i}"
            self.router.expect_client(client_id, buffer, task.first + i)
            self.in_engine[client_id] = shard
            requests.append((client_id, prompt, self.PARAMS))
        self.queued = [b for b in self.queued if b.entries or b.error is not None]
        self.queued.append(self.engine.queue_requests(requests, stop_at_layer=self.stop))
        self.stats.shard_seconds += time.perf_counter() - started
        return prepared

    def _finish_ready(self) -> None:
        """Finish the oldest shards that are complete, then raise a later shard's storage failure:
        the shards before it are whole and a resumed run starts after them."""
        started = time.perf_counter()
        while self.open and self.open[0].unfinished == 0 and self.open[0].buffer.complete:
            shard = self.open.popleft()
            self.router.forget(shard.buffer)
            task, buffer = shard.job.task, shard.buffer
            self.store.finish(shard.job, shard.allocation, {
                "shard": task.shard, "file": self.spec.file_name(task.shard), "start": task.first,
                "stop": task.first + len(task.prompts), "rows": buffer.rows})
            self.stats.shards += 1
        for shard in self.open:
            shard.buffer.check()
        self.stats.shard_seconds += time.perf_counter() - started


def serial_steps_warning(engine: Any, spec: ShardSpec) -> str | None:
    """Why a GPU would wait for the host between a window run's steps, or None.

    The engine schedules step N + 1 while the device runs step N, from the requests not in flight;
    a request stays in the engine (a sequence slot, its KV blocks) until its step is collected. With
    at most as many windows in the engine as one step takes, step N + 1 finds none to run, and the
    host admits, plans and builds it only once step N is done. On an H100 that left the device
    44-46 % busy (``saelens_split``, 1b8b952, 256 windows of 128 tokens a step, 256 sequences)."""
    if spec.context_size is None or engine.device.type != "cuda":
        return None
    per_step = engine.scheduler.max_num_batched_tokens // spec.context_size
    in_engine = min(spec.batch_size, engine.scheduler.max_num_seqs)
    if in_engine >= 2 * per_step:
        return None
    return (f"corpus capture: a step takes up to {per_step} windows (max_num_batched_tokens "
            f"{engine.scheduler.max_num_batched_tokens} // context_size {spec.context_size}) but at most {in_engine} "
            f"are in the engine (batch_size {spec.batch_size}, max_num_seqs {engine.scheduler.max_num_seqs}): the "
            f"next step is built only once the one before has finished, so the GPU waits for the host. Set "
            f"batch_size and max_num_seqs to at least {2 * per_step}.")


def stop_layer(engine: Any, spec: ShardSpec) -> int:
    """The layers a shard's requests run: up to the captured point (the SAE's, for features), as
    TransformerLens' ``stop_at_layer`` does; nothing above it changes a captured row."""
    if spec.sae is None:
        return layers_needed(spec.layers, spec.hook)
    sae = engine.saes.get(spec.sae)
    return layers_needed(getattr(sae, "layers", [sae.layer]), sae.hook)


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
