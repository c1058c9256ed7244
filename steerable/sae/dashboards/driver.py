"""``feature_dashboards``: every feature's dashboard of a registered SAE over a corpus, in one pass.

The engine prefills each text once (``max_tokens=1``) while a ``hidden_states`` capture stream
takes every prompt row at the SAE's point into a sink that uploads each step's rows to the device
in one copy and gathers each text's rows there (views of those uploads). Texts whose rows are all
in go, a few thousand rows at a time and shard by shard in corpus order, to the device
accumulator (encode, statistics, candidates merged into the example pools with their windows), whose
pools and statistics the host state takes after each shard.
Nothing of the corpus is kept: a text's rows are dropped once its chunk is processed.

With ``out`` the run is resumable: after each shard of ``shard_size`` texts the state is written
(``files.checkpoint``) and a resumed run skips the shards it lists. ``plan`` checks a run,
``run_shards`` folds shards into a state and ``logits`` makes the logit tables: the parts a
data-parallel driver runs on its replicas (``steerable.ray.dashboards``), merging their states
with ``DashboardState.merge`` (exact).
"""

from __future__ import annotations

import functools
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from steerable.capture.store import StreamRows
from steerable.checks import is_int
from steerable.errors import EngineError, InvalidRequestError
from steerable.hook_points import HIDDEN_STATES, layers_needed
from steerable.long_runs import frozen_heap, quick_handoff
from steerable.sae.dashboards import files
from steerable.sae.dashboards.accumulate import Chunk, DeviceAccumulator, FeatureEncoder
from steerable.sae.dashboards.logits import LogitTables, logit_tables, unembedding
from steerable.sae.dashboards.result import FeatureDashboards
from steerable.sae.dashboards.settings import (
    DashboardSettings,
    check_context,
    check_features,
    check_indices,
    check_texts,
    corpus_hash,
    positive_int,
)
from steerable.sae.dashboards.state import DashboardState
from steerable.sae.model import SAE
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec

# Elements of the float32 [rows, features] block encoded at once: 2 GiB on a GPU (8,192 rows of 65,536
# features; each chunk's pool work launches about a thousand kernels whatever its rows, and on the
# H200 at 1M tokens the pass ran at 43.8 % of sparse capture's speed with 8,192 rows against 29.2 %
# with 4,096 and 40.4 % with 16,384), 1 GiB on a CPU.
CHUNK_ELEMENTS = {"cuda": 2**29, "cpu": 2**28}
MAX_CHUNK_ROWS = 8192

@dataclass(frozen=True)
class DashboardRun:
    """A checked run: its settings, and how the pass reads the corpus (texts per shard, texts in
    the engine at a time, rows encoded at once); none of the three changes the result."""

    settings: DashboardSettings
    shard_size: int
    batch_size: int
    chunk_rows: int

    @property
    def num_shards(self) -> int:
        return -(-self.settings.num_texts // self.shard_size)


def plan(llm: Any, texts: Sequence[str | Sequence[int]], sae: str, n_top: int = 20, context: tuple[int, int] = (24, 8),
         quantiles: int = 10, n_quantile: int = 5, n_logits: int = 10, bins: int = 40, seed: int = 0,
         features: Any = None, *, exclude_positions: Sequence[int] = (), exclude_tokens: Sequence[int] = (),
         batch_size: int = 256, chunk_rows: int | None = None, shard_size: int | None = None,
         model: str | None = None) -> DashboardRun:
    """Every argument of ``feature_dashboards`` checked against ``llm`` and its SAE ``sae``, before any work."""
    engine = llm.llm_engine
    found = engine.saes.get(sae, "sae")
    if not isinstance(found, SAE):
        raise InvalidRequestError(f"sae: {sae!r} is a {type(found).__name__}; feature dashboards are computed for SAEs")
    texts = check_texts(texts)
    positive_int(n_top, "n_top")
    before, after = check_context(context, engine.max_model_len)
    for name, value, minimum in (("quantiles", quantiles, 0), ("n_quantile", n_quantile, 0),
                                 ("n_logits", n_logits, 1), ("bins", bins, 1), ("batch_size", batch_size, 1)):
        positive_int(value, name, minimum)
    if not is_int(seed):
        raise InvalidRequestError(f"seed: expected an integer, got {seed!r}")
    settings = DashboardSettings(
        model=model or engine.config.model, sae=sae, sae_sha256=found.content_hash.hex(), layer=found.layer,
        hook=found.hook, d_sae=found.d_sae, architecture=found.architecture,
        features=check_features(features, found.d_sae), n_top=n_top, before=before, after=after,
        quantiles=quantiles, n_quantile=n_quantile, n_logits=n_logits, bins=bins, seed=seed,
        exclude_positions=check_indices(exclude_positions, "exclude_positions"),
        exclude_tokens=check_indices(exclude_tokens, "exclude_tokens"), num_texts=len(texts),
        corpus_sha256=corpus_hash(texts))
    if chunk_rows is None:
        per_row = found.d_sae if found.architecture == "topk" else len(settings.feature_ids())
        elements = CHUNK_ELEMENTS["cuda" if engine.device.type == "cuda" else "cpu"]
        chunk_rows = max(before + after + 1, min(MAX_CHUNK_ROWS, elements // per_row))
    elif not is_int(chunk_rows) or chunk_rows < before + after + 1:
        raise InvalidRequestError(f"chunk_rows: must be an integer >= {before + after + 1} (a window), got "
                                  f"{chunk_rows!r}")
    shard_size = len(texts) if shard_size is None else positive_int(shard_size, "shard_size")
    if engine.capture_status(HIDDEN_STATES)["enabled"]:
        raise InvalidRequestError("feature_dashboards: the hidden_states capture stream is running; stop it first "
                                  "(dashboards read the SAE's point through that stream)")
    unembedding(engine)  # refused now, not after the pass, on an engine whose head is elsewhere
    return DashboardRun(settings, shard_size, batch_size, chunk_rows)


def feature_dashboards(llm: Any, texts: Sequence[str | Sequence[int]], sae: str, n_top: int = 20,
                       context: tuple[int, int] = (24, 8), quantiles: int = 10, n_quantile: int = 5,
                       n_logits: int = 10, bins: int = 40, seed: int = 0, features: Any = None, *,
                       exclude_positions: Sequence[int] = (), exclude_tokens: Sequence[int] = (),
                       batch_size: int = 256, chunk_rows: int | None = None, out: str | os.PathLike | None = None,
                       resume: bool = False, shard_size: int | None = None, use_tqdm: bool = False,
                       model: str | None = None, export: dict[str, Any] | None = None) -> FeatureDashboards:
    """Dashboards of ``features`` (None: all) of the registered SAE ``sae`` over ``texts`` (strings
    or token-id lists): per feature the ``n_top`` highest activations with ``context`` =
    ``(before, after)`` tokens around each, ``n_quantile`` seeded samples from each of ``quantiles``
    bins, statistics, a ``bins``-bin histogram and the ``n_logits`` top and bottom logits.
    ``exclude_positions`` (positions in a text, e.g. ``[0]``: a first-token attention sink) and
    ``exclude_tokens`` (token ids, e.g. BOS, as sae-dashboard's ``ignore_tokens``) are tokens whose
    activations are taken as 0: seen, never firing, never an example.

    ``batch_size``: texts in the engine at a time; ``chunk_rows``: rows encoded at once (default from
    the feature count); neither changes the result. ``out``: also write a finished dashboards
    directory there, checkpointing every ``shard_size`` texts (default: the corpus is one shard) so
    ``resume=True`` continues a killed run; the result equals an uninterrupted run's. ``export``:
    ``FeatureDashboards.save`` options for that directory; ``model``: the model's name recorded."""
    run = plan(llm, texts, sae, n_top, context, quantiles, n_quantile, n_logits, bins, seed, features,
               exclude_positions=exclude_positions, exclude_tokens=exclude_tokens, batch_size=batch_size,
               chunk_rows=chunk_rows, shard_size=shard_size, model=model)
    state, done = None, []
    if out is not None:
        finished, state, done = files.open_run(Path(out), run.settings, run.shard_size, resume)
        if finished:
            return FeatureDashboards.load(out)
    state = state if state is not None else empty_state(run)

    def shard_done(k: int, finished_state: DashboardState) -> None:
        done.append(k)
        if out is not None:
            files.checkpoint(Path(out), run.settings, run.shard_size, sorted(done), finished_state)

    run_shards(llm, texts, run, state, [k for k in range(run.num_shards) if k not in set(done)], shard_done,
               use_tqdm)
    tables, vocab_size = logits(llm, run)
    tokenizer = llm.get_tokenizer()
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: f"<{t}>")  # a model without one
    result = FeatureDashboards(run.settings, state, tables, functools.lru_cache(maxsize=None)(decode), vocab_size)
    if out is not None:
        result.save(out, **(export or {}))
    return result


def empty_state(run: DashboardRun) -> DashboardState:
    s = run.settings
    return DashboardState.empty(len(s.feature_ids()), s.n_top, s.quantiles, s.n_quantile, s.bins, s.window)


def logits(llm: Any, run: DashboardRun) -> tuple[LogitTables, int]:
    """The run's logit tables and the vocabulary size."""
    engine = llm.llm_engine
    W_U, scale = unembedding(engine)
    return logit_tables(engine.saes.get(run.settings.sae), run.settings.feature_ids(), W_U, scale,
                        run.settings.n_logits), W_U.shape[0]


def run_shards(llm: Any, texts: Sequence[Any], run: DashboardRun, state: DashboardState, shards: list[int],
               shard_done: Any = None, use_tqdm: bool = False) -> DashboardState:
    """Fold shards ``shards`` (of ``run.shard_size`` texts, corpus indices global) into ``state``
    and return it; ``shard_done(k, state)`` is called as each finishes, in order. One pass over
    them: the engine's hidden_states stream must be free. The part a data-parallel driver runs on
    each replica (``steerable.ray.dashboards``), merging the states with ``DashboardState.merge``."""
    engine = llm.llm_engine
    settings = run.settings
    encoder = FeatureEncoder(engine.saes.get(settings.sae), settings.feature_ids(), engine.device, engine.dtype)
    accumulator = DeviceAccumulator(encoder, settings.feature_ids(), state, settings.n_top, settings.before,
                                    settings.after, settings.seed, engine.device)
    with tqdm(desc="Dashboards", unit="tok", unit_scale=True, disable=not use_tqdm) as bar:
        _Pass(engine, texts, settings, accumulator, state, shards, run.shard_size, run.batch_size, run.chunk_rows,
              shard_done, bar).run()
    return state


@dataclass
class _Text:
    example: int
    tokens: torch.Tensor  # int32 [L]
    pieces: list[torch.Tensor] = field(default_factory=list)  # its rows in position order, views of step uploads
    filled: int = 0

    def rows(self, start: int, end: int) -> list[torch.Tensor]:
        """Views of its rows ``[start, end)``."""
        views, at = [], 0
        for piece in self.pieces:
            if at < end and at + len(piece) > start:
                views.append(piece[max(start - at, 0):min(end, at + len(piece)) - at])
            at += len(piece)
        return views


@dataclass
class _Shard:
    index: int
    remaining: int  # texts whose rows are not all in
    ready: deque = field(default_factory=deque)  # complete texts not yet processed
    pending: int = 0  # their rows


class _Pass:
    """The engine loop (this thread) and the sink (the capture plane's sink thread on a GPU, this
    thread otherwise): rows into per-text buffers, complete texts into chunks, shard by shard."""

    PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
    threaded = True  # as a sink: fed on the capture plane's thread where there is one

    def __init__(self, engine: Any, texts: Sequence[Any], settings: DashboardSettings,
                 accumulator: DeviceAccumulator, state: DashboardState, shards: list[int], shard_size: int,
                 batch_size: int, chunk_rows: int, shard_done: Any, bar: tqdm):
        self.engine, self.texts, self.settings = engine, texts, settings
        self.accumulator, self.state = accumulator, state
        self.shard_size, self.batch_size, self.chunk_rows = shard_size, batch_size, chunk_rows
        self.shard_done, self.bar = shard_done, bar
        self.shards = deque(_Shard(k, min(shard_size, len(texts) - k * shard_size)) for k in shards)
        self.by_index = {s.index: s for s in self.shards}
        self.buffers: dict[str, tuple[_Shard, _Text]] = {}  # engine request id -> its text
        self.added = [0, 0]  # texts and tokens sent to the engine, for the progress bar's total
        self.todo_texts = sum(s.remaining for s in self.shards)
        self.stop = layers_needed([settings.layer], settings.hook)  # the layers above the SAE's never run

    # ------------------------------------------------------------ the engine loop

    def run(self) -> None:
        """The pass, its heap frozen (``frozen_heap``); on a GPU with the GIL handed over quickly
        (``quick_handoff``)."""
        with frozen_heap(), quick_handoff(self.engine.device.type):
            return self._run()

    def _run(self) -> None:
        engine, settings = self.engine, self.settings
        engine.start_capture(HIDDEN_STATES, [settings.layer], None, "all", SelectSpec.parse("all_prompt"), None,
                             settings.hook, sink=self)
        in_engine: dict[str, int] = {}
        feed = self._feed()
        try:
            try:
                while True:
                    while len(in_engine) < self.batch_size and self._add(next(feed, None), in_engine):
                        pass
                    if not in_engine:
                        break
                    for out in engine.step():
                        if out.finished and out.request_id in in_engine:
                            self.bar.update(in_engine.pop(out.request_id))
                engine.finish_inflight()
            except BaseException:
                engine.abort_request(list(in_engine))
                raise
        finally:
            engine.stop_capture(HIDDEN_STATES)  # returns once the sink has taken every row
        self._advance()
        if self.shards:
            raise EngineError(f"feature_dashboards: shard {self.shards[0].index} is missing rows of "
                              f"{self.shards[0].remaining} texts after the pass")

    def _feed(self) -> Iterator[tuple[_Shard, int, list[int]]]:
        for shard in list(self.shards):
            start = shard.index * self.shard_size
            for example in range(start, start + shard.remaining):
                yield shard, example, self._tokenize(example)

    def _tokenize(self, example: int) -> list[int]:
        try:
            ids = self.engine.tokenize(self.texts[example])
        except InvalidRequestError as err:
            raise InvalidRequestError(f"texts[{example}]: {err}") from None
        if not ids:
            raise InvalidRequestError(f"texts[{example}]: no tokens")
        return ids

    def _add(self, item: tuple[_Shard, int, list[int]] | None, in_engine: dict[str, int]) -> bool:
        if item is None:
            return False
        shard, example, ids = item
        self.added[0] += 1
        self.added[1] += len(ids)
        self.bar.total = self.bar.n + round(self.added[1] / self.added[0] * (self.todo_texts - self.added[0])) + sum(
            in_engine.values()) + len(ids)  # tokens: those done, in the engine, and an estimate of the rest
        try:
            group = self.engine.add_request(f"dashboards-{example}", ids, self.PARAMS, stop_at_layer=self.stop)
        except InvalidRequestError as err:
            raise InvalidRequestError(f"texts[{example}]: {err}") from None
        self.buffers[group.children[0].request_id] = (shard, _Text(example, torch.tensor(ids, dtype=torch.int32)))
        in_engine[group.client_id] = len(ids)
        return True

    # ------------------------------------------------------------ the sink

    def append(self, rows: StreamRows) -> None:
        """A step's rows, copied out of the step's host block at once (it is reused after this call)
        in one copy to the device that encodes them, of which each text keeps its views; a text goes
        to its shard once full. The rows never pass through host memory of the pass's own."""
        lo, hi = int(rows.where.min()), int(rows.where.max()) + 1
        block = self.accumulator.upload(rows.block[0][lo:hi])
        starts = np.concatenate(([0], np.cumsum(rows.counts)[:-1]))
        for request_id, start, count in zip(rows.request_ids, starts.tolist(), rows.counts.tolist()):
            shard, text = self.buffers[request_id]
            first = int(rows.positions[start])
            if first != text.filled or first + count > len(text.tokens):
                raise EngineError(f"feature_dashboards: text {text.example}'s rows {first}..{first + count} arrived "
                                  f"after {text.filled} of its {len(text.tokens)} rows, not once each in order")
            where = rows.where[start:start + count] - lo
            if where[-1] - where[0] == count - 1:  # the usual case: the request's rows lie together in the step
                text.pieces.append(block[where[0]:where[0] + count])
            else:
                with self.accumulator.on_stream():
                    text.pieces.append(block[torch.from_numpy(where).to(block.device)])
            text.filled += count
            if text.filled == len(text.tokens):
                del self.buffers[request_id]
                shard.ready.append(text)
                shard.pending += len(text.tokens)
                shard.remaining -= 1
        self._advance()

    def _advance(self) -> None:
        """Process the oldest shard's complete texts a chunk at a time (the last one may be short);
        finish shards that are done, in order."""
        while self.shards:
            shard = self.shards[0]
            if shard.pending >= self.chunk_rows or (shard.remaining == 0 and shard.ready):
                self._process(shard)
            elif shard.remaining or shard.ready:
                return
            else:
                self.shards.popleft()
                self.accumulator.host_state(self.state)
                if self.shard_done is not None:
                    self.shard_done(shard.index, self.state)

    def _process(self, shard: _Shard) -> None:
        """One chunk of the shard's complete texts: as many whole texts as fit ``chunk_rows``, or a
        longer text alone, in pieces that carry ``before``/``after`` rows of context."""
        before, after = self.settings.before, self.settings.after
        text = shard.ready[0]
        length = len(text.tokens)
        if length > self.chunk_rows:
            shard.ready.popleft()
            shard.pending -= length
            core = self.chunk_rows - before - after
            for start in range(0, length, core):
                self._process_chunk([(text, start, min(length, start + core))])
            return
        batch, rows = [], 0
        while shard.ready and rows + len(shard.ready[0].tokens) <= self.chunk_rows:
            text = shard.ready.popleft()
            batch.append((text, 0, len(text.tokens)))
            rows += len(text.tokens)
        shard.pending -= rows
        self._process_chunk(batch)

    def _process_chunk(self, pieces: list[tuple[_Text, int, int]]) -> None:
        """Encode the pieces (text, first core position, end of core) together; merge the candidates."""
        texts = [text for text, _, _ in pieces]
        core_lo, core_hi = np.array([[lo, hi] for _, lo, hi in pieces]).reshape(-1, 2).T
        lo = np.maximum(core_lo - self.settings.before, 0)
        hi = np.minimum(core_hi + self.settings.after, [len(text.tokens) for text in texts])
        lengths = hi - lo
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        position = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)])
        tokens = torch.cat([text.tokens[a:b] for text, a, b in zip(texts, lo, hi)])
        core = (position >= np.repeat(core_lo, lengths)) & (position < np.repeat(core_hi, lengths))
        excluded = np.isin(position, self.settings.exclude_positions) | np.isin(tokens.numpy(),
                                                                               self.settings.exclude_tokens)
        with self.accumulator.on_stream():
            rows = torch.cat([view for text, a, b in zip(texts, lo, hi) for view in text.rows(int(a), int(b))])
        chunk = Chunk(rows, example=torch.from_numpy(np.repeat([text.example for text in texts], lengths)),
                      position=torch.from_numpy(position), tokens=tokens, core=torch.from_numpy(core),
                      lo=torch.from_numpy(starts), hi=torch.from_numpy(starts + np.repeat(lengths, lengths)),
                      excluded=torch.from_numpy(excluded))
        self.accumulator.process(chunk)
