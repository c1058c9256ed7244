"""``DashboardState``: everything a pass has gathered about its features, on the host, in a form
that merges exactly with another pass over other texts (another shard, or a resumed run's finished
part): counts and sums add, maxima take the larger, histograms move to the common grid and add
(``grid``), example pools merge (``merge``). Its size depends on the number of features and the
example counts asked for, never on the corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load, load_file, save

from steerable.errors import InvalidRequestError
from steerable.files import write_safetensors
from steerable.sae.dashboards.grid import bin_index, grid_exponent, regrid
from steerable.sae.dashboards.merge import (
    Order,
    Places,
    merge_rows,
    reservoir_order,
    top_order,
)


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


class Pool:
    """One kind of example list of every feature: the places (``Places`` [F, n]) and, per place,
    the window around its example: ``acts`` (float32, NaN outside the text) and ``tokens`` (int32,
    -1 outside), ``[F, n, window]``."""

    def __init__(self, places: Places, acts: torch.Tensor, tokens: torch.Tensor):
        self.places, self.acts, self.tokens = places, acts, tokens

    @staticmethod
    def empty(features: int, size: int, window: int) -> "Pool":
        return Pool(Places.empty(features, size), torch.full((features, size, window), float("nan")),
                    torch.full((features, size, window), -1, dtype=torch.int32))

    def write(self, features: torch.Tensor, places: torch.Tensor, acts: torch.Tensor, tokens: torch.Tensor) -> None:
        """The windows of examples that just took places ``[features, places]``."""
        self.acts[features, places] = acts
        self.tokens[features, places] = tokens

    def take_in(self, other: "Pool", order: Order, cap: int) -> None:
        """Merge ``other``'s examples (of the same features, over other texts) in, with their windows."""
        features, size = other.places.shape
        arriving = Places(*other.places.columns()[:4], torch.arange(features * size).view(features, size))
        rows = torch.arange(features)
        new, row, place, source = merge_rows(self.places, arriving, rows, order, cap)
        self.places.set_rows(rows, new)
        window = other.acts.shape[-1]
        self.write(rows[row], place, other.acts.view(-1, window)[source], other.tokens.view(-1, window)[source])

    def state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        return {**self.places.state_dict(prefix), f"{prefix}.acts": self.acts, f"{prefix}.tokens": self.tokens}

    @staticmethod
    def from_state_dict(tensors: dict[str, torch.Tensor], prefix: str) -> "Pool":
        return Pool(Places.from_state_dict(tensors, prefix), tensors[f"{prefix}.acts"], tensors[f"{prefix}.tokens"])


class DashboardState:
    """The dense statistics plus two example pools per feature: ``top`` (``n_top`` places) and
    ``reservoir`` (``quantiles * n_quantile`` places, at most ``n_quantile`` per quantile bin)."""

    def __init__(self, dense: Dense, top: Pool, reservoir: Pool, n_quantile: int):
        self.dense, self.top, self.reservoir, self.n_quantile = dense, top, reservoir, n_quantile

    @staticmethod
    def empty(features: int, n_top: int, quantiles: int, n_quantile: int, bins: int, window: int) -> "DashboardState":
        return DashboardState(Dense.zeros(features, bins, quantiles), Pool.empty(features, n_top, window),
                              Pool.empty(features, quantiles * n_quantile, window), n_quantile)

    @property
    def quantiles(self) -> int:
        return self.dense.qcount.shape[1]

    def merge(self, other: "DashboardState") -> None:
        """Take in a state of the same features over other texts; exact (see ``merge``)."""
        if self.top.places.shape != other.top.places.shape or self.reservoir.places.shape != \
                other.reservoir.places.shape or self.n_quantile != other.n_quantile:
            raise InvalidRequestError("merge: the states hold different features or example counts")
        self.dense = self.dense.merged(other.dense)
        self.top.take_in(other.top, top_order, self.top.places.shape[1])
        if self.reservoir.places.shape[1]:
            self.reservoir.take_in(other.reservoir, reservoir_order(grid_exponent(self.dense.peak, self.quantiles)),
                                   self.n_quantile)

    # ------------------------------------------------------------ reading one feature

    def top_places(self, row: int) -> list[int]:
        """Feature ``row``'s top places, best first."""
        p = self.top.places
        held = p.held()[row].nonzero().squeeze(1).tolist()
        return sorted(held, key=lambda j: (-float(p.value[row, j]), int(p.example[row, j]), int(p.position[row, j])))

    def quantile_places(self, row: int) -> dict[int, list[int]]:
        """Feature ``row``'s reservoir places by quantile bin (on the grid of its max), each by key."""
        p = self.reservoir.places
        held = p.held()[row].nonzero().squeeze(1)
        if not len(held):
            return {}
        exponent = grid_exponent(self.dense.peak[row:row + 1], self.quantiles).expand(len(held))
        bins = bin_index(p.value[row, held], exponent).tolist()
        out: dict[int, list[int]] = {}
        for b, j in sorted(zip(bins, held.tolist()),
                           key=lambda bj: (bj[0], int(p.key[row, bj[1]]), int(p.example[row, bj[1]]),
                                           int(p.position[row, bj[1]]))):
            out.setdefault(b, []).append(j)
        return out

    # ------------------------------------------------------------ files

    def tensors(self) -> dict[str, torch.Tensor]:
        d = self.dense
        return {"tokens": torch.tensor([d.tokens]), "count": d.count, "total": d.total, "peak": d.peak,
                "hist": d.hist, "qcount": d.qcount, "n_quantile": torch.tensor([self.n_quantile]),
                **self.top.state_dict("top"), **self.reservoir.state_dict("reservoir")}

    def save(self, path: str) -> None:
        write_safetensors({name: t.contiguous() for name, t in self.tensors().items()}, path)

    def to_bytes(self) -> bytes:
        """The state as safetensors bytes (what a replica sends back; nothing is pickled)."""
        return save({name: t.contiguous() for name, t in self.tensors().items()})

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> "DashboardState":
        dense = Dense(int(t["tokens"][0]), t["count"], t["total"], t["peak"], t["hist"], t["qcount"])
        return DashboardState(dense, Pool.from_state_dict(t, "top"), Pool.from_state_dict(t, "reservoir"),
                              int(t["n_quantile"][0]))

    @staticmethod
    def from_bytes(data: bytes) -> "DashboardState":
        return DashboardState.from_tensors(load(data))

    @staticmethod
    def load(path: str) -> "DashboardState":
        try:
            return DashboardState.from_tensors(load_file(path))
        except (OSError, KeyError, ValueError) as err:
            raise InvalidRequestError(f"{path}: not a readable dashboards state ({type(err).__name__}: {err})"
                                      ) from None
