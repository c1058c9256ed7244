"""``DashboardState``: everything a pass has gathered about its features, on the host, in a form
that merges exactly with another pass over other texts (another shard, or a resumed run's finished
part): counts and sums add, maxima take the larger, histograms move to the common grid and add
(``grid``), example lists merge (``merge``). Its size depends on the number of features and the
example counts asked for, never on the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from steerable.errors import InvalidRequestError
from steerable.sae.dashboards.grid import NO_EXPONENT, grid_exponent, regrid
from steerable.sae.dashboards.merge import Items, Slots, merge_reservoir, merge_top


@dataclass
class Dense:
    """Per-feature statistics: ``count`` of non-zero activations, their float64 ``total`` and
    ``peak`` (the largest), ``hist`` [F, bins] and ``qcount`` [F, quantiles] on the grid of
    ``peak``, over ``tokens`` tokens seen."""

    tokens: int
    count: torch.Tensor
    total: torch.Tensor
    peak: torch.Tensor
    hist: torch.Tensor
    qcount: torch.Tensor

    @staticmethod
    def zeros(features: int, bins: int, quantiles: int, device: torch.device | str = "cpu") -> "Dense":
        return Dense(0, torch.zeros(features, dtype=torch.long, device=device),
                     torch.zeros(features, dtype=torch.float64, device=device),
                     torch.zeros(features, dtype=torch.float32, device=device),
                     torch.zeros(features, bins, dtype=torch.long, device=device),
                     torch.zeros(features, quantiles, dtype=torch.long, device=device))

    def to(self, device: torch.device | str) -> "Dense":
        return Dense(self.tokens, *(t.to(device) for t in (self.count, self.total, self.peak, self.hist, self.qcount)))

    def merged(self, other: "Dense") -> "Dense":
        peak = torch.maximum(self.peak, other.peak)
        bins, quantiles = self.hist.shape[1], self.qcount.shape[1]
        return Dense(self.tokens + other.tokens, self.count + other.count, self.total + other.total, peak,
                     regrid(self.hist, self.peak, peak, bins) + regrid(other.hist, other.peak, peak, bins),
                     regrid(self.qcount, self.peak, peak, quantiles)
                     + regrid(other.qcount, other.peak, peak, quantiles))


class DashboardState:
    """The dense statistics plus the example slots: ``top`` [F, 1, n_top] and ``reservoir``
    [F, quantiles, n_quantile], the latter binned on ``reservoir_exponent`` [F]."""

    def __init__(self, dense: Dense, top: Slots, reservoir: Slots, reservoir_exponent: torch.Tensor):
        self.dense = dense
        self.top = top
        self.reservoir = reservoir
        self.reservoir_exponent = reservoir_exponent

    @staticmethod
    def empty(features: int, n_top: int, quantiles: int, n_quantile: int, bins: int, window: int) -> "DashboardState":
        return DashboardState(Dense.zeros(features, bins, quantiles), Slots(features, 1, n_top, window),
                              Slots(features, quantiles, n_quantile, window),
                              torch.full((features,), NO_EXPONENT, dtype=torch.long))

    @property
    def quantiles(self) -> int:
        return self.reservoir.shape[1]

    def add_examples(self, arriving: Items, peak: torch.Tensor) -> torch.Tensor:
        """Merge candidate examples in, ``peak`` being the features' maxima over everything seen
        with them (it fixes the quantile grid); returns the features whose lists changed."""
        touched_top = merge_top(self.top, arriving)
        if self.quantiles == 0 or self.reservoir.shape[2] == 0:
            return touched_top
        exponent = grid_exponent(peak, self.quantiles)
        touched_res = merge_reservoir(self.reservoir, arriving, exponent, self.reservoir_exponent)
        self.reservoir_exponent[touched_res] = exponent[touched_res]
        return torch.unique(torch.cat([touched_top, touched_res]))

    def merge(self, other: "DashboardState") -> None:
        """Take in a state of the same features over other texts; exact (see the module docstring)."""
        if self.top.shape != other.top.shape or self.reservoir.shape != other.reservoir.shape:
            raise InvalidRequestError(f"merge: states of different shapes ({self.top.shape}, {self.reservoir.shape} "
                                      f"and {other.top.shape}, {other.reservoir.shape})")
        self.dense = self.dense.merged(other.dense)
        everything = torch.arange(self.top.shape[0])
        arriving = Items.cat([other.top.items(everything), other.reservoir.items(everything)]).unique()
        self.add_examples(arriving, self.dense.peak)

    # ------------------------------------------------------------ thresholds for the device filter

    def thresholds(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For ``features``: the activation an example must reach to enter the top list (0 while it
        is not full), the quantile grid, and per bin the key an example must not exceed (the last
        place's key, ``KEY_EMPTY`` while the bin is not full)."""
        return (self.top.value[features, 0, -1], self.reservoir_exponent[features],
                self.reservoir.key[features, :, -1] if self.reservoir.shape[2] else
                torch.zeros(len(features), self.quantiles, dtype=torch.long))

    # ------------------------------------------------------------ files

    def tensors(self) -> dict[str, torch.Tensor]:
        d = self.dense
        return {"tokens": torch.tensor([d.tokens]), "count": d.count, "total": d.total, "peak": d.peak,
                "hist": d.hist, "qcount": d.qcount, "reservoir_exponent": self.reservoir_exponent,
                **self.top.state_dict("top"), **self.reservoir.state_dict("reservoir")}

    def save(self, path: str) -> None:
        save_file({name: t.contiguous() for name, t in self.tensors().items()}, path)

    @staticmethod
    def load(path: str) -> "DashboardState":
        try:
            t = load_file(path)
            dense = Dense(int(t["tokens"][0]), t["count"], t["total"], t["peak"], t["hist"], t["qcount"])
            return DashboardState(dense, Slots.from_state_dict(t, "top"), Slots.from_state_dict(t, "reservoir"),
                                  t["reservoir_exponent"])
        except (OSError, KeyError, ValueError) as err:
            raise InvalidRequestError(f"{path}: not a readable dashboards state ({type(err).__name__}: {err})") from None
