"""What users read: ``FeatureDashboards`` (every computed feature's dashboard, by feature index) and
the ``FeatureDashboard`` of one feature, built when asked for from the run's columnar state (a
65,536-feature run is never turned into Python objects all at once)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.sae.dashboards import files
from steerable.sae.dashboards.grid import edges
from steerable.sae.dashboards.logits import LOGIT_BINS, LogitTables
from steerable.sae.dashboards.settings import DashboardSettings
from steerable.sae.dashboards.state import DashboardState, Pool


@dataclass
class Example:
    """One activation of the feature in its context: the window's ``tokens`` (ids) and
    ``token_strs``, the feature's ``activations`` on each, the text's ``corpus_index``, the
    ``position`` of the activating token in that text, ``start`` (the position of the window's
    first token) and ``max`` (the activation at ``position``)."""

    tokens: list[int]
    token_strs: list[str]
    activations: list[float]
    corpus_index: int
    position: int
    start: int
    max: float

    @property
    def offset(self) -> int:
        """Where the activating token is in the window."""
        return self.position - self.start


@dataclass
class QuantileGroup:
    """A quantile bin ``[low, high)``: how many tokens fall in it, and the examples drawn from it."""

    low: float
    high: float
    count: int
    examples: list[Example]


@dataclass
class Histogram:
    """Counts of non-zero activations per bin; ``edges`` has one more entry than ``counts``."""

    counts: list[int]
    edges: list[float]


@dataclass
class LogitEntry:
    token: int
    token_str: str
    value: float


@dataclass
class FeatureDashboard:
    index: int
    top: list[Example]
    quantiles: list[QuantileGroup]
    tokens: int  # tokens seen
    count: int  # tokens where the activation > 0
    max: float
    mean: float  # of the non-zero activations
    histogram: Histogram
    top_logits: list[LogitEntry]
    bottom_logits: list[LogitEntry]
    logits_histogram: Histogram

    @property
    def density(self) -> float:
        return self.count / self.tokens if self.tokens else 0.0

    @property
    def dead(self) -> bool:
        return self.count == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "density": self.density, "dead": self.dead}


class FeatureDashboards:
    """Dashboards of the features of one SAE over one corpus: ``dash[i]`` is feature ``i``'s."""

    def __init__(self, settings: DashboardSettings, state: DashboardState, logits: LogitTables,
                 token_str: Callable[[int], str], vocab_size: int):
        self.settings = settings
        self.state = state
        self.logits = logits
        self.token_str = token_str
        self.vocab_size = vocab_size
        self.feature_ids = settings.feature_ids()
        self._row = {int(f): i for i, f in enumerate(self.feature_ids.tolist())}

    @property
    def features(self) -> list[int]:
        return self.feature_ids.tolist()

    @property
    def dead(self) -> list[int]:
        """Features that never fired on the corpus."""
        return self.feature_ids[self.state.dense.count == 0].tolist()

    @property
    def tokens(self) -> int:
        return self.state.dense.tokens

    def __len__(self) -> int:
        return len(self._row)

    def __iter__(self) -> Iterator[int]:
        return iter(self.features)

    def __contains__(self, index: object) -> bool:
        return index in self._row

    def row(self, index: Any) -> int:
        """The state row of feature ``index``, or an error naming ``feature``."""
        if not is_int(index) or index not in self._row:
            raise InvalidRequestError(f"feature: {index!r} is not a feature these dashboards computed "
                                      f"({len(self)} of d_sae={self.settings.d_sae})")
        return self._row[index]

    def __getitem__(self, index: int) -> FeatureDashboard:
        row = self.row(index)
        dense, s = self.state.dense, self.settings
        count, peak = int(dense.count[row]), float(dense.peak[row])
        histogram = Histogram(dense.hist[row].tolist(), edges(peak, s.bins) if count else [])
        groups = []
        if count and s.quantiles:
            bin_edges = edges(peak, s.quantiles)
            sampled = self.state.quantile_places(row)
            for b in range(s.quantiles):
                number = int(dense.qcount[row, b])
                if number:
                    examples = self._examples(self.state.reservoir, row, sampled.get(b, []))
                    groups.append(QuantileGroup(bin_edges[b], bin_edges[b + 1], number, examples))
        lg = self.logits
        lg_edges = torch.linspace(float(lg.low[row]), float(lg.high[row]), LOGIT_BINS + 1).tolist()
        return FeatureDashboard(
            index=index, top=self._examples(self.state.top, row, self.state.top_places(row)), quantiles=groups,
            tokens=dense.tokens,
            count=count, max=peak, mean=float(dense.total[row]) / count if count else 0.0, histogram=histogram,
            top_logits=self._logits(lg.top_ids[row], lg.top_values[row]),
            bottom_logits=self._logits(lg.bottom_ids[row], lg.bottom_values[row]),
            logits_histogram=Histogram(lg.hist[row].tolist(), lg_edges))

    def _examples(self, pool: Pool, row: int, places: list[int]) -> list[Example]:
        out = []
        p = pool.places
        for place in places:
            tokens = pool.tokens[row, place]
            inside = tokens >= 0
            first = int(inside.nonzero()[0])
            ids = tokens[inside].tolist()
            position = int(p.position[row, place])
            out.append(Example(ids, [self.token_str(t) for t in ids], pool.acts[row, place][inside].tolist(),
                               int(p.example[row, place]), position, position - self.settings.before + first,
                               float(p.value[row, place])))
        return out

    def _logits(self, ids: torch.Tensor, values: torch.Tensor) -> list[LogitEntry]:
        return [LogitEntry(t, self.token_str(t), v) for t, v in zip(ids.tolist(), values.tolist())]

    def save(self, out: str | os.PathLike, batch_features: int = 128, model_id: str = "", sae_set: str = "",
             dataset: str = "") -> list[str]:
        """Write a finished dashboards directory (see ``files``): the state, the vocabulary and the
        Neuronpedia export, ``batch_features`` features per ``batch-N.json`` (``model_id``,
        ``sae_set``: Neuronpedia's names, default the model's and the SAE's). Returns the batch files."""
        return files.save(self, out, batch_features, model_id, sae_set, dataset)

    @staticmethod
    def load(out: str | os.PathLike) -> "FeatureDashboards":
        """A finished directory, as ``save`` (or ``steerable dashboards``) wrote it."""
        settings, state, logits, vocab = files.load(out)
        return FeatureDashboards(settings, state, logits, vocab.__getitem__, len(vocab))

    def summary(self) -> dict[str, Any]:
        """Per-run facts for an index page (no examples)."""
        dense = self.state.dense
        return {"features": len(self), "tokens": dense.tokens, "dead": len(self.dead),
                "mean_density": float(dense.count.double().mean()) / dense.tokens if dense.tokens else math.nan}
