"""The device half of a dashboard pass: encode a chunk of corpus rows with the SAE, fold every
non-zero activation into the running statistics and histograms, pick the few activations that may
still enter an example list and merge them into the pools' places (all on the device); only the
windows of the examples that took a place go to the host.

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
from dataclasses import dataclass

import torch

from steerable.capture.features import sae_weights
from steerable.sae.dashboards.grid import NO_EXPONENT, bin_index, grid_exponent, regrid, sample_keys
from steerable.sae.dashboards.merge import KEY_EMPTY, Places, descending, merge_rows, pack, reservoir_order, top_order
from steerable.sae.dashboards.state import DashboardState
from steerable.sae.model import SAE
from steerable.sae.worker_tables import _DeviceSae


@dataclass
class Chunk:
    """Corpus rows to encode together. ``rows`` [R, d_in] (model dtype) may be on the device; the
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


@dataclass
class Placed:
    """Examples that took places in a pool during a chunk, with their windows (host tensors)."""

    features: torch.Tensor
    places: torch.Tensor
    acts: torch.Tensor
    tokens: torch.Tensor


class DeviceAccumulator:
    """The run's statistics and example pools' places on the device, the thresholds of the filter,
    and ``process`` (one chunk -> the windows of the examples it placed, for the host's pools)."""

    def __init__(self, encoder: FeatureEncoder, feature_ids: torch.Tensor, state: DashboardState, n_top: int,
                 before: int, after: int, seed: int, device: torch.device):
        self.encoder = encoder
        self.device = device
        self.seed, self.n_top, self.n_quantile = seed, n_top, state.n_quantile
        self.bins, self.quantiles = state.dense.hist.shape[1], state.quantiles
        self.sampling = self.quantiles > 0 and self.n_quantile > 0
        self.dense = state.dense.to(device)
        self.top = state.top.places.to(device)
        self.reservoir = state.reservoir.places.to(device)
        self.feature_ids = feature_ids.to(device)
        features = len(feature_ids)
        self.tau_top = torch.zeros(features, dtype=torch.float32, device=device)
        self.tau_grid = torch.full((features,), NO_EXPONENT, dtype=torch.long, device=device)
        self.tau_res = torch.full((features, max(self.quantiles, 1)), KEY_EMPTY, dtype=torch.long, device=device)
        self.offsets = torch.arange(-before, after + 1, device=device)
        self._thresholds(torch.arange(features, device=device))
        # A stream of its own: its waits (nonzero, copies to the host) wait for its work only, and
        # its kernels run beside the engine's steps instead of queueing behind them.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def host_state(self, state: DashboardState) -> None:
        """Copy the statistics and places into ``state`` (whose windows the chunks filled)."""
        if self.stream is not None:
            self.stream.synchronize()
        state.dense = self.dense.to("cpu")
        state.top.places = self.top.to("cpu")
        state.reservoir.places = self.reservoir.to("cpu")

    def process(self, chunk: Chunk) -> tuple[Placed, Placed]:
        """Fold the chunk into the statistics, merge its candidates into the pools; returns the
        examples placed in the top pool and in the reservoir, with their windows."""
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.stream is not None
                                      else contextlib.nullcontext()):
            return self._process(chunk)

    def _process(self, chunk: Chunk) -> tuple[Placed, Placed]:
        device = self.device
        act = self.encoder(chunk.rows.to(device, non_blocking=True))
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
            return self._nothing(), self._nothing()
        r, f, v, key = r[picked], f[picked], v[picked], key[picked]
        example, position = example[picked], position[picked]
        source = torch.arange(len(picked), device=device)
        columns = (v, example, position, key, source)
        rows, arriving = pack(f, torch.zeros_like(f), descending(v), self.n_top, 1, columns)
        top = self._merge("top", rows, arriving, top_order, self.n_top)
        placed = [top]
        if self.sampling:
            exponent = grid_exponent(self.dense.peak, self.quantiles)
            order = reservoir_order(exponent)
            rows, arriving = pack(f, bin_index(v, exponent[f]), key, self.n_quantile, self.quantiles, columns)
            placed.append(self._merge("reservoir", rows, arriving, order, self.n_quantile))
        self._thresholds(torch.unique(f))
        used = torch.unique(torch.cat([p[2] for p in placed]))  # candidates that took a place
        windows = self._windows(act, chunk, r[used], f[used])
        out = []
        for features, places, which in placed:
            at = torch.searchsorted(used, which)
            out.append(Placed(features.cpu(), places.cpu(), windows[0][at.cpu()], windows[1][at.cpu()]))
        if not self.sampling:
            out.append(self._nothing())
        return out[0], out[1]

    def _nothing(self) -> Placed:
        window = len(self.offsets)
        return Placed(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                      torch.empty(0, window, dtype=torch.float32), torch.empty(0, window, dtype=torch.int32))

    def _merge(self, name: str, rows: torch.Tensor, arriving: Places, order, cap: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool: Places = getattr(self, name)
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
        inside, window = inside.cpu(), window.cpu()  # + 0.0 above: no -0.0 from the threshold
        return acts.cpu(), torch.where(inside, chunk.tokens[window], -1).to(torch.int32)

    def _thresholds(self, features: torch.Tensor) -> None:
        """The filter's thresholds of ``features`` from their pools: the lowest activation of a full
        top list (0 otherwise); per quantile bin (on the current grid) the largest key of a full bin."""
        top = self.top.rows(features)
        full = top.held().all(1)
        self.tau_top[features] = torch.where(full, top.value.amin(1), 0.0)
        if not self.sampling:
            return
        grid = grid_exponent(self.dense.peak[features], self.quantiles)
        res = self.reservoir.rows(features)
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
        for name, n in (("hist", self.bins), ("qcount", self.quantiles)):
            if n == 0:
                continue
            counts = regrid(getattr(d, name), d.peak, peak, n)
            where = f * n + bin_index(v, grid_exponent(peak, n)[f])
            counts.view(-1).index_add_(0, where, torch.ones_like(where))
            setattr(d, name, counts)
        d.peak = peak
