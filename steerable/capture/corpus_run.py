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
from steerable.hook_points import HIDDEN_STATES
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

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
        self.in_engine: dict[str, _OpenShard] = {}  # client id -> its shard

    def run(self, tasks: Iterator[ShardTask]) -> None:
        ahead = 0
        for _ in range(FILES_AHEAD):
            ahead += self._prepare(next(tasks, None))
        feed = self._examples(ahead, tasks)
        engine, spec = self.engine, self.spec
        if spec.sae is None:
            engine.start_capture(HIDDEN_STATES, list(spec.layers), spec.dtype, "all", self.select, None, spec.hook,
                                 sink=self.router)
        else:
            engine.start_capture(SAE_FEATURES, None, None, "all", self.select, None, spec.hook,
                                 sink=_SplitFeatures(self.router), saes=[spec.sae], top_k=spec.top_k)
        try:
            try:
                while True:
                    while len(self.in_engine) < spec.batch_size and self._add(next(feed, None)):
                        pass
                    if not self.in_engine:
                        break
                    started = time.perf_counter()
                    outputs = engine.step()
                    self.stats.step_seconds += time.perf_counter() - started
                    for out in outputs:
                        if out.finished and out.request_id in self.in_engine:
                            self.in_engine.pop(out.request_id).unfinished -= 1
                            if self.on_example is not None:
                                self.on_example()
                    self._finish_ready()
                engine.finish_inflight()  # its rows belong to finished requests: delivered nowhere
            except BaseException:
                engine.abort_request(list(self.in_engine))
                raise
        finally:
            engine.stop_capture(spec.stream)  # returns once the sink thread has stored every row
        self._finish_ready()
        for shard in self.open:  # every request is done and every row delivered
            shard.buffer.check_complete()

    def _prepare(self, task: ShardTask | None) -> int:
        if task is None:
            return 0
        started = time.perf_counter()
        if any(isinstance(p, str) for p in task.prompts):  # texts: tokenized as add_request would
            task = ShardTask(task.shard, task.first, [self.engine.tokenize(p) for p in task.prompts])
        self.store.prepare(task, [len(self.select.prompt_positions_selected(p)) for p in task.prompts])
        self.stats.shard_seconds += time.perf_counter() - started
        return 1

    def _examples(self, prepared: int, tasks: Iterator[ShardTask]) -> Iterator[tuple[_OpenShard, int, Any]]:
        """(shard, example index, prompt) in corpus order, opening each shard as its turn comes."""
        while prepared:
            job, allocation = self.store.take()
            prepared += self._prepare(next(tasks, None)) - 1  # set up while earlier shards are captured
            started = time.perf_counter()
            task = job.task
            buffer = ShardBuffer(task.first, job.counts, job.file.data, job.file.labels, job.file.wait_rows)
            job.file = None  # the storage goes with the buffer
            shard = _OpenShard(job, allocation, buffer, len(task.prompts))
            self.open.append(shard)
            self.stats.shard_seconds += time.perf_counter() - started
            for i, prompt in enumerate(task.prompts):
                yield shard, task.first + i, prompt

    def _add(self, item: tuple[_OpenShard, int, Any] | None) -> bool:
        if item is None:
            return False
        shard, example, prompt = item
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        group = self.engine.add_request(f"corpus-{example}", prompt, self.PARAMS)
        self.in_engine[group.client_id] = shard
        self.router.expect(group.children[0].request_id, shard.buffer, example)
        return True

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
