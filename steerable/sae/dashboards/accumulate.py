"""The device half of a dashboard pass: encode a chunk of corpus rows with the SAE, fold every
non-zero activation into the running statistics and histograms (on the device), and pick the few
activations that may still enter an example list, each with its window of activations.

A chunk holds whole texts, or a piece of a long text with ``before``/``after`` rows of context on
each side (``core`` says which rows the chunk counts), so every window is read from the chunk
itself: the activations of the examples' neighbours never have to be kept or recomputed.

The filter is conservative: an activation is a candidate when it reaches the lowest activation of
its feature's full top list, or its key does not exceed the largest key of its quantile bin's full
list (on the grid those lists were binned on; an activation beyond that grid always passes). The
thresholds only tighten as the host merges candidates in, so a stale threshold passes more, never
fewer: the lists come out the same however often they are refreshed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from steerable.sae.dashboards.grid import NO_EXPONENT, bin_index, grid_exponent, regrid, sample_keys
from steerable.sae.dashboards.merge import KEY_EMPTY, Items
from steerable.sae.dashboards.state import Dense
from steerable.sae.model import SAE


@dataclass
class Chunk:
    """Corpus rows to encode together. ``rows`` [R, d_in] (model dtype) may be on the device; the
    labels are host tensors: ``example`` (corpus index), ``position``, ``tokens``; ``core`` marks the
    rows counted (not a piece's context); ``lo``/``hi`` bound each row's text (or piece) in the chunk."""

    rows: torch.Tensor
    example: torch.Tensor
    position: torch.Tensor
    tokens: torch.Tensor
    core: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


class FeatureEncoder:
    """The SAE's activations of the features asked for, float32, as the engine's feature capture
    computes them (``b_dec`` folded into the bias, products accumulated in float32). A top-k SAE
    needs every pre-activation to know which ``k`` survive; the others encode only their columns."""

    def __init__(self, sae: SAE, features: torch.Tensor, device: torch.device, dtype: torch.dtype):
        self.k = sae.k if sae.architecture == "topk" else None
        columns = slice(None) if self.k is not None else features
        self.columns = features.to(device) if self.k is not None else None
        W_enc = sae.W_enc.to(dtype)[:, columns]
        bias = sae.b_enc.float()[columns]
        if sae.apply_b_dec_to_input:  # (x - b) @ W + c == x @ W + (c - b @ W)
            bias = bias - sae.b_dec.float() @ W_enc.float()
        self.W_enc = W_enc.to(device)
        self.bias = bias.to(device)
        self.threshold = (None if sae.threshold is None else
                          sae.threshold.float()[columns].to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype != torch.float32:
            pre = torch.mm(x, self.W_enc, out_dtype=torch.float32)
        else:
            pre = torch.mm(x, self.W_enc).float()
        pre += self.bias
        if self.threshold is not None:
            pre.mul_(pre > self.threshold)
        acts = pre.relu_()
        if self.k is None:
            return acts
        top = torch.topk(acts, min(self.k, acts.shape[1]), dim=1)
        kept = torch.zeros_like(acts).scatter_(1, top.indices, top.values)
        return kept[:, self.columns]


class DeviceAccumulator:
    """Running statistics of the run's features on the device, the thresholds of the filter, and
    ``process`` (one chunk -> candidate ``Items`` on the host)."""

    def __init__(self, encoder: FeatureEncoder, feature_ids: torch.Tensor, dense: Dense, bins: int, quantiles: int,
                 n_quantile: int, before: int, after: int, seed: int, device: torch.device):
        self.encoder = encoder
        self.device = device
        self.bins, self.quantiles, self.seed = bins, quantiles, seed
        self.sampling = quantiles > 0 and n_quantile > 0
        self.dense = dense.to(device)
        self.feature_ids = feature_ids.to(device)
        features = len(feature_ids)
        self.tau_top = torch.zeros(features, dtype=torch.float32, device=device)
        self.res_exp = torch.full((features,), NO_EXPONENT, dtype=torch.long, device=device)
        self.tau_res = torch.full((features, max(quantiles, 1)), KEY_EMPTY, dtype=torch.long, device=device)
        self.offsets = torch.arange(-before, after + 1, device=device)

    def set_thresholds(self, features: torch.Tensor, tau_top: torch.Tensor, res_exp: torch.Tensor,
                       tau_res: torch.Tensor) -> None:
        index = features.to(self.device)
        self.tau_top[index] = tau_top.to(self.device)
        self.res_exp[index] = res_exp.to(self.device)
        if self.sampling:
            self.tau_res[index] = tau_res.to(self.device)

    def host_dense(self) -> Dense:
        return self.dense.to("cpu")

    def host_peak(self) -> torch.Tensor:
        return self.dense.peak.to("cpu")

    @torch.inference_mode()
    def process(self, chunk: Chunk) -> Items:
        device = self.device
        act = self.encoder(chunk.rows.to(device, non_blocking=True))
        num_rows, num_features = act.shape
        core = chunk.core.to(device)
        r, f = ((act > 0) & core.unsqueeze(1)).nonzero(as_tuple=True)
        v = act[r, f]
        self._fold(r, f, v, int(chunk.core.sum()))
        keep = v >= self.tau_top[f]
        example, position = chunk.example.to(device)[r], chunk.position.to(device)[r]
        key = sample_keys(self.seed, self.feature_ids[f], example, position)
        if self.sampling:
            grid = self.res_exp[f]
            unset = grid == NO_EXPONENT
            b = bin_index(v, torch.where(unset, 0, grid))
            beyond = unset | (b >= self.quantiles)
            keep |= beyond | (key <= self.tau_res[f, b.clamp(0, self.quantiles - 1)])
        picked = keep.nonzero().squeeze(1)
        r, f, v, key = r[picked], f[picked], v[picked], key[picked]
        window = r.unsqueeze(1) + self.offsets
        lo, hi = chunk.lo.to(device)[r], chunk.hi.to(device)[r]
        inside = (window >= lo.unsqueeze(1)) & (window < hi.unsqueeze(1))
        flat = window.clamp(0, num_rows - 1) * num_features + f.unsqueeze(1)
        acts = torch.where(inside, act.view(-1)[flat] + 0.0, float("nan"))  # + 0.0: no -0.0 from the threshold
        r, window, inside = r.cpu(), window.clamp(0, num_rows - 1).cpu(), inside.cpu()
        tokens = torch.where(inside, chunk.tokens[window], -1).to(torch.int32)
        return Items(f.cpu(), v.cpu(), chunk.example[r], chunk.position[r], key.cpu(), acts.cpu(), tokens)

    def _fold(self, r: torch.Tensor, f: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
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
