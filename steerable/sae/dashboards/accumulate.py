"""The device half of a dashboard pass: encode a chunk of corpus rows with the SAE, fold every
non-zero activation into the running statistics and histograms, pick the few activations that may
still enter an example list and set them aside with their windows; every few chunks, merge those
into the pools' places and write the windows of those that took a place (all on the device, where
the windows fit there).

A chunk holds whole texts, or a piece of a long text with ``before``/``after`` rows of context on
each side (``core`` says which rows the chunk counts), so every window is read from the chunk
itself: the activations of the examples' neighbours never have to be kept or recomputed.

The filter is conservative: an activation is a candidate when it reaches the lowest activation of
its feature's full top list, or its key does not exceed the largest key of its full quantile bin
(on the grid the thresholds were taken on; an activation beyond that grid always passes): nothing
the merge would keep is dropped, so the pools come out as if every activation had been merged.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from steerable.capture.features import sae_weights
from steerable.sae.dashboards.grid import NO_EXPONENT, bin_index, grid_exponent, move_to_grid, sample_keys
from steerable.sae.dashboards.merge import KEY_EMPTY, Places, descending, merge_rows, pack, reservoir_order, top_order
from steerable.sae.dashboards.state import DashboardState, Pool
from steerable.sae.model import SAE
from steerable.sae.worker_tables import _DeviceSae


@dataclass
class Chunk:
    """Corpus rows to encode together. ``rows`` [R, d_in] (model dtype) on the device; the
    labels are host tensors: ``example`` (corpus index), ``position``, ``tokens``; ``core`` marks the
    rows counted (not a piece's context); ``lo``/``hi`` bound each row's text (or piece) in the chunk;
    ``excluded`` rows (positions or tokens the run excludes) have every activation taken as 0."""

    rows: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    tokens: torch.Tensor
    core: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    excluded: torch.Tensor


class FeatureEncoder:
    """The SAE's activations of the features asked for, float32, computed by the worker's own
    encoder (the activations feature capture returns). A top-k SAE needs every pre-activation to
    know which ``k`` survive; the others encode only their columns."""

    def __init__(self, sae: SAE, features: torch.Tensor, device: torch.device, dtype: torch.dtype):
        weights = sae_weights(sae, dtype)
        self.k = sae.k if weights.architecture == "topk" else None
        self.columns = features.to(device)
        if self.k is None:
            weights = dataclasses.replace(
                weights, W_enc=weights.W_enc[:, features], b_enc=weights.b_enc[features],
                threshold=None if weights.threshold is None else weights.threshold[features])
        self.encoder = _DeviceSae(weights, device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        acts = self.encoder.encode(x)
        return acts if self.k is None else acts[:, self.columns]


class DeviceAccumulator:
    """The run's statistics and example pools on the device, the thresholds of the filter, and
    ``process`` (one chunk folded in, its candidates set aside with their windows until a merge
    places them). The pools' windows stay on the device where they fit in a quarter of its free
    memory (65,536 features with the default sizes: 1.2 GB), so a merge's placements are a scatter
    there rather than a copy to the host and a scatter in host memory; otherwise they live on the host."""

    # The CUDA priority of its stream (lower runs first): each chunk waits on its own kernels a
    # few times while the engine's steps fill the device, and the pass goes at the sink's speed, so
    # its kernels go first (H100, 1M tokens, 8,192 rows: 15.8 s against 19.1 s at priority 0;
    # ``dashboards_chunks --stream-priorities 0,-1`` measures it).
    stream_priority = -1
    # A merge is some 400 small kernels and a few waits on the device whatever its size, so the
    # candidates of a few chunks go together, their windows kept meanwhile (a cost per candidate).
    # Early in a pass, when nearly every activation is a candidate, a chunk of ``merge_candidates``
    # or more merges at once and reads the windows of those that took a place alone.
    merge_every = 4
    merge_candidates = 2**16

    def __init__(self, encoder: FeatureEncoder, feature_ids: torch.Tensor, state: DashboardState, n_top: int,
                 before: int, after: int, seed: int, device: torch.device):
        self.encoder = encoder
        self.device = device
        self.seed, self.n_top, self.n_quantile = seed, n_top, state.n_quantile
        self.bins, self.quantiles = state.dense.hist.shape[1], state.quantiles
        self.sampling = self.quantiles > 0 and self.n_quantile > 0
        self.dense = state.dense.to(device)
        # Each bin count's grid (of ``dense.peak``), kept from chunk to chunk rather than recomputed.
        self.grids = {n: grid_exponent(self.dense.peak, n) for n in (self.bins, self.quantiles) if n}
        windows = window_device(state, device)
        self.pools = {name: Pool(pool.places.to(device), pool.acts.to(windows), pool.tokens.to(windows))
                      for name, pool in (("top", state.top), ("reservoir", state.reservoir))}
        self.feature_ids = feature_ids.to(device)
        features = len(feature_ids)
        self.tau_top = torch.zeros(features, dtype=torch.float32, device=device)
        self.tau_grid = torch.full((features,), NO_EXPONENT, dtype=torch.long, device=device)
        self.tau_res = torch.full((features, max(self.quantiles, 1)), KEY_EMPTY, dtype=torch.long, device=device)
        self.offsets = torch.arange(-before, after + 1, device=device)
        self.pending: list[tuple[torch.Tensor, ...]] = []  # per chunk: its candidates' columns and windows
        self._thresholds(torch.arange(features, device=device))
        # A stream of its own: its waits (nonzero, copies to the host) wait for its work only, and
        # its kernels run beside the engine's steps instead of queueing behind them.
        self.stream = torch.cuda.Stream(device, priority=self.stream_priority) if device.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def host_state(self, state: DashboardState) -> None:
        """Merge the candidates still waiting, then copy the statistics and pools into ``state``."""
        with self.on_stream():
            self._merge_pending()
        if self.stream is not None:
            self.stream.synchronize()
        state.dense = self.dense.to("cpu")
        state.top, state.reservoir = (Pool(pool.places.to("cpu"), pool.acts.to("cpu"), pool.tokens.to("cpu"))
                                      for pool in (self.pools["top"], self.pools["reservoir"]))

    def on_stream(self) -> contextlib.AbstractContextManager:
        """Inference mode on the accumulator's stream: where the rows it reads are allocated and
        copied, so nothing it frees can be reused by another stream's work still reading it."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode())
        if self.stream is not None:
            stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def upload(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of host ``rows`` where the chunks are encoded (the device), finished when this
        returns: the caller's host block is reused once it has."""
        with self.on_stream():
            if self.stream is None:
                return rows.clone()
            copy = rows.to(self.device, non_blocking=True)
            self.stream.synchronize()
            return copy

    def process(self, chunk: Chunk) -> None:
        """Fold the chunk into the statistics and set its candidates aside with their windows; every
        ``merge_every`` chunks (or ``merge_candidates`` candidates) merge them into the pools."""
        with self.on_stream():
            self._process(chunk)

    def _process(self, chunk: Chunk) -> None:
        device = self.device
        act = self.encoder(chunk.rows)
        if chunk.excluded.any():
            act[chunk.excluded.nonzero().squeeze(1).to(device)] = 0.0
        fires = act > 0
        if not bool(chunk.core.all()):  # a long text's piece: its context rows are not counted here
            fires &= chunk.core.to(device).unsqueeze(1)
        r, f = fires.nonzero(as_tuple=True)
        v = act[r, f]
        self._fold(f, v, int(chunk.core.sum()))
        example, position = chunk.example.to(device)[r], chunk.position.to(device)[r]
        key = sample_keys(self.seed, self.feature_ids[f], example, position)
        keep = v >= self.tau_top[f]
        if self.sampling:
            grid = self.tau_grid[f]
            unset = grid == NO_EXPONENT
            b = bin_index(v, torch.where(unset, 0, grid))
            keep |= unset | (b >= self.quantiles) | (key <= self.tau_res[f, b.clamp(0, self.quantiles - 1)])
        picked = keep.nonzero().squeeze(1)
        if len(picked) == 0:
            return
        r, f = r[picked], f[picked]
        columns = (f, v[picked], example[picked], position[picked], key[picked])
        if len(picked) >= self.merge_candidates:  # early in a pass: merge now, windows for the placed alone
            self._merge_pending()
            self._merge_candidates(*columns, lambda which: self._windows(act, chunk, r[which], f[which]))
            return
        self.pending.append((*columns, *self._windows(act, chunk, r, f)))
        if len(self.pending) >= self.merge_every or sum(len(p[0]) for p in self.pending) >= self.merge_candidates:
            self._merge_pending()

    def _merge_pending(self) -> None:
        """Merge the candidates set aside, with the windows kept for them."""
        if not self.pending:
            return
        *columns, acts, tokens = (torch.cat(column) for column in zip(*self.pending))
        self.pending = []
        self._merge_candidates(*columns, lambda which: (acts[which], tokens[which]))

    def _merge_candidates(self, f: torch.Tensor, v: torch.Tensor, example: torch.Tensor, position: torch.Tensor,
                          key: torch.Tensor, windows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                          ) -> None:
        """Merge candidates into the pools, write the windows (``windows(candidates)``) of those
        that took a place and tighten the thresholds of their features. Exact whenever it runs:
        what a merge keeps depends only on the union of what the pools hold and what arrives, and
        thresholds that lag the pools only let more candidates through."""
        columns = (v, example, position, key, torch.arange(len(f), device=self.device))
        features, arriving = pack(f, torch.zeros_like(f), descending(v), self.n_top, 1, columns)
        placed = [self._merge("top", features, arriving, top_order, self.n_top)]
        if self.sampling:
            exponent = self.grids[self.quantiles]
            rows, arriving = pack(f, bin_index(v, exponent[f]), key, self.n_quantile, self.quantiles, columns)
            placed.append(self._merge("reservoir", rows, arriving, reservoir_order(exponent), self.n_quantile))
        self._thresholds(features)  # pack's rows: the features present, each once
        used = torch.unique(torch.cat([which for _, _, which in placed]))  # candidates that took a place
        acts, tokens = windows(used)
        for name, (rows, places, which) in zip(("top", "reservoir"), placed):
            to = self.pools[name].acts.device
            at = torch.searchsorted(used, which)
            self.pools[name].write(rows.to(to), places.to(to), acts[at].to(to), tokens[at].to(to))

    def _merge(self, name: str, rows: torch.Tensor, arriving: Places, order, cap: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool: Places = self.pools[name].places
        new, row, place, source = merge_rows(pool, arriving, rows, order, cap)
        pool.set_rows(rows, new)
        return rows[row], place, source

    def _windows(self, act: torch.Tensor, chunk: Chunk, r: torch.Tensor, f: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The feature's activations (NaN outside the text) and the tokens (-1) around rows ``r``."""
        num_rows, num_features = act.shape
        window = r.unsqueeze(1) + self.offsets
        lo, hi = chunk.lo.to(self.device)[r], chunk.hi.to(self.device)[r]
        inside = (window >= lo.unsqueeze(1)) & (window < hi.unsqueeze(1))
        window = window.clamp(0, num_rows - 1)
        acts = torch.where(inside, act.view(-1)[window * num_features + f.unsqueeze(1)] + 0.0, float("nan"))
        tokens = torch.where(inside, chunk.tokens.to(self.device)[window], -1).to(torch.int32)
        return acts, tokens  # + 0.0 above: no -0.0 from the threshold

    def _thresholds(self, features: torch.Tensor) -> None:
        """The filter's thresholds of ``features`` from their pools: the lowest activation of a full
        top list (0 otherwise); per quantile bin (on the current grid) the largest key of a full bin."""
        top = self.pools["top"].places.rows(features)
        full = top.held().all(1)
        self.tau_top[features] = torch.where(full, top.value.amin(1), 0.0)
        if not self.sampling:
            return
        grid = self.grids[self.quantiles][features]
        res = self.pools["reservoir"].places.rows(features)
        held = res.held()
        b = bin_index(res.value, grid.unsqueeze(1).expand_as(res.value)).clamp(0, self.quantiles - 1)
        b = torch.where(held, b, 0)
        count = torch.zeros(len(features), self.quantiles, dtype=torch.long, device=self.device)
        count.scatter_add_(1, b, held.long())
        largest = torch.zeros_like(count).scatter_reduce_(1, b, torch.where(held, res.key, 0), "amax")
        self.tau_res[features] = torch.where(count >= self.n_quantile, largest, KEY_EMPTY)
        self.tau_grid[features] = grid

    def _fold(self, f: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
        """Counts, sums, maxima and both bin counts of the chunk's non-zero activations."""
        d = self.dense
        d.tokens += tokens
        d.count.index_add_(0, f, torch.ones_like(f))
        d.total.index_add_(0, f, v.double())
        peak = d.peak.scatter_reduce(0, f, v, "amax")
        grids = {n: grid_exponent(peak, n) for n in self.grids}  # bins and quantiles may be equal
        for name, n in (("hist", self.bins), ("qcount", self.quantiles)):
            if n == 0:
                continue
            counts = move_to_grid(getattr(d, name), self.grids[n], grids[n])
            where = f * n + bin_index(v, grids[n][f])
            counts.view(-1).index_add_(0, where, torch.ones_like(where))
            setattr(d, name, counts)
        d.peak, self.grids = peak, grids


def window_device(state: DashboardState, device: torch.device) -> torch.device:
    """Where the pools' windows are kept: on the device if they take at most a quarter of its free
    memory, on the host otherwise (their size depends on the features and example counts asked for)."""
    if device.type != "cuda":
        return device
    size = sum(t.numel() * t.element_size() for pool in (state.top, state.reservoir) for t in (pool.acts, pool.tokens))
    return device if size <= torch.cuda.mem_get_info(device)[0] // 4 else torch.device("cpu")
