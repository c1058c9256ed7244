"""The steering data plane on the worker: device tables indexed by row, updated from the plain
``SteeringUpdate`` of each step, and the per-step view the hook points apply.

Row 0 of every table is zeros (an additive row) or strength 0 (a clamp slot): tokens that are not
steered use it and come out bit for bit unchanged. Tables only grow; the driver decides when (and
bumps the layout version it sends), so every rank reallocates at the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from steerable.hook_points import MLP_OUT, SiteWrite
from steerable.layers import fused
from steerable.steering.edit_tables import EditTables
from steerable.steering.ops import add_rows, clamp_rows
from steerable.step import (CLAMP_PARAMS, NO_CLAMP, NO_GATE, Site, SteeringPlan, SteeringUpdate, TableWrite,
                            to_device)


class SteeringTables:
    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype,
                 owns: Callable[[Site], bool] = lambda site: True, max_tokens: int = 0, max_seqs: int = 0):
        """``owns(site)``: whether this worker runs that site (a pipeline stage holds its own layers);
        ``max_tokens`` / ``max_seqs``: a step's most rows and request slots (``EditTables``)."""
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.owns = owns
        self.capacity = 1
        self.add: dict[Site, torch.Tensor] = {}  # [capacity, H]
        self.clamp_dir: dict[Site, torch.Tensor] = {}  # [capacity, slots, H] unit directions
        self.clamp_bounds: dict[Site, torch.Tensor] = {}  # float32 [capacity, slots, 4]: lo, hi, strength, factor
        # Only at sites with a feature clamp: what is written (a projection clamp writes its read
        # direction) and the read's gate, float32 [capacity, slots, 2]: bias, threshold.
        self.clamp_write: dict[Site, torch.Tensor] = {}  # [capacity, slots, H]
        self.clamp_gate: dict[Site, torch.Tensor] = {}
        # Transcoder clamps, by the site where they read: read directions, bounds and gates as a
        # feature clamp's, and the directions written at mlp_out of each layer from the source on.
        self.tclamp_dir: dict[Site, torch.Tensor] = {}  # [capacity, slots, H]
        self.tclamp_bounds: dict[Site, torch.Tensor] = {}  # float32 [capacity, slots, 4]
        self.tclamp_gate: dict[Site, torch.Tensor] = {}  # float32 [capacity, slots, 2]
        self.tclamp_write: dict[Site, torch.Tensor] = {}  # [capacity, slots, span, H]
        self.edits = EditTables(hidden_size, device, dtype, owns, max_tokens, max_seqs)

    # ------------------------------------------------------------ updates from the driver

    def apply(self, update: SteeringUpdate) -> None:
        """One host-to-device copy of the update's buffer; each table then takes its rows from
        views of it (the distinct vectors cast to the model's dtype and gathered, one op each)."""
        self._grow(update.capacity)
        if update.edits:
            self.edits.apply(update.edits)
        writes = [write for write in update.writes if self.owns(write.site)]
        if not writes:
            return
        bits, params, distinct = update.split(to_device(update.data, self.device))
        indices = bits.view(torch.int32).long()
        rows, vectors = indices[:update.num_rows], distinct.to(self.dtype)[indices[update.num_rows:]]
        for write in writes:
            index = rows[write.row_span]
            if write.table == "add":
                table = self.add.get(write.site)
                if table is None:
                    table = self.add[write.site] = torch.zeros(self.capacity, self.hidden_size, dtype=self.dtype,
                                                               device=self.device)
                table.index_copy_(0, index, vectors[write.vector_span()])
            elif write.table == "tclamp":
                self._write_tclamps(write, index, vectors, params)
            else:
                self._write_clamps(write, index, vectors, params)

    def _write_clamps(self, write: TableWrite, index: torch.Tensor, vectors: torch.Tensor,
                      params: torch.Tensor) -> None:
        """Every table of the site at once: the driver packs every slot at the table's width
        (``RowTables``), with write directions and gates at every site that has them."""
        site, n, slots = write.site, write.n, write.slots
        self._ensure_clamp_slots(site, slots)
        self.clamp_dir[site].index_copy_(0, index, vectors[write.vector_span()].view(n, slots, self.hidden_size))
        self.clamp_bounds[site].index_copy_(0, index, params[write.bound_span].view(n, slots, CLAMP_PARAMS))
        if write.split:
            if site not in self.clamp_write:
                self.clamp_write[site] = self.clamp_dir[site].clone()  # rows written so far: projection clamps
                self.clamp_gate[site] = torch.tensor(NO_GATE, device=self.device).repeat(
                    *self.clamp_dir[site].shape[:2], 1)
            self.clamp_write[site].index_copy_(0, index, vectors[write.vector_span(written=True)].view(
                n, slots, self.hidden_size))
            self.clamp_gate[site].index_copy_(0, index, params[write.gate_span].view(n, slots, 2))

    def _write_tclamps(self, write: TableWrite, index: torch.Tensor, vectors: torch.Tensor,
                       params: torch.Tensor) -> None:
        """A transcoder clamp site's tables (reallocated, when the driver says they are wider, at the
        new slot count and span: every row is rewritten then, since the version changed)."""
        site, n, slots, span, hidden = write.site, write.n, write.slots, write.span, self.hidden_size
        have = self.tclamp_write.get(site)
        if have is None or have.shape[1] < slots or have.shape[2] < span:
            old = (self.tclamp_dir.get(site), self.tclamp_bounds.get(site), self.tclamp_gate.get(site), have)
            self.tclamp_dir[site] = torch.zeros(self.capacity, slots, hidden, dtype=self.dtype, device=self.device)
            self.tclamp_bounds[site] = torch.tensor(NO_CLAMP, device=self.device).repeat(self.capacity, slots, 1)
            self.tclamp_gate[site] = torch.tensor(NO_GATE, device=self.device).repeat(self.capacity, slots, 1)
            self.tclamp_write[site] = torch.zeros(self.capacity, slots, span, hidden, dtype=self.dtype,
                                                  device=self.device)
            if have is not None:  # rows written earlier keep their contents
                k, t = have.shape[1], have.shape[2]
                self.tclamp_dir[site][:, :k] = old[0]
                self.tclamp_bounds[site][:, :k] = old[1]
                self.tclamp_gate[site][:, :k] = old[2]
                self.tclamp_write[site][:, :k, :t] = have
        self.tclamp_dir[site][index, :write.slots] = vectors[write.vector_span()].view(n, write.slots, hidden)
        self.tclamp_bounds[site][index, :write.slots] = params[write.bound_span].view(n, write.slots, CLAMP_PARAMS)
        self.tclamp_gate[site][index, :write.slots] = params[write.gate_span].view(n, write.slots, 2)
        self.tclamp_write[site][index, :write.slots, :write.span] = vectors[write.vector_span(written=True)].view(
            n, write.slots, write.span, hidden)

    def _grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        for tables, fill in ((self.add, 0.0), (self.clamp_dir, 0.0), (self.clamp_bounds, NO_CLAMP),
                             (self.clamp_write, 0.0), (self.clamp_gate, NO_GATE), (self.tclamp_dir, 0.0),
                             (self.tclamp_bounds, NO_CLAMP), (self.tclamp_gate, NO_GATE), (self.tclamp_write, 0.0)):
            for site, old in tables.items():
                tables[site] = _grown(old, capacity, fill)
        self.edits.grow(capacity)
        self.capacity = capacity

    def _ensure_clamp_slots(self, site: Site, slots: int) -> None:
        have = self.clamp_dir[site].shape[1] if site in self.clamp_dir else 0
        if have >= slots:
            return
        directions = torch.zeros(self.capacity, slots, self.hidden_size, dtype=self.dtype, device=self.device)
        bounds = torch.tensor(NO_CLAMP, device=self.device).repeat(self.capacity, slots, 1)
        if have:
            directions[:, :have] = self.clamp_dir[site]
            bounds[:, :have] = self.clamp_bounds[site]
        if site in self.clamp_write:
            write, gate = torch.zeros_like(directions), torch.tensor(NO_GATE, device=self.device).repeat(
                self.capacity, slots, 1)
            write[:, :have] = self.clamp_write[site]
            gate[:, :have] = self.clamp_gate[site]
            self.clamp_write[site], self.clamp_gate[site] = write, gate
        self.clamp_dir[site], self.clamp_bounds[site] = directions, bounds

    # ------------------------------------------------------------ per step

    def step_view(self, plan: SteeringPlan, index: torch.Tensor, views: Any = None) -> "StepSteering":
        """``views``: the step's staged inputs (``worker.input_buffers.StepViews``), which a prompt-scope gate reads."""
        return StepSteering(self, plan, index, views)


def _grown(old: torch.Tensor, capacity: int, fill: float | tuple[float, ...]) -> torch.Tensor:
    """``old`` with rows up to ``capacity``, the new ones filled with 'no steering'."""
    row = torch.tensor(fill, dtype=old.dtype, device=old.device)
    new = row.expand(capacity, *old.shape[1:]).clone()
    new[: old.shape[0]] = old
    return new


class StepSteering:
    """What the hook points ask of steering in one step: does anything act at a site, its writes as
    table lookups (what the fused norm applies), and apply them on their own.

    A transcoder clamp reads at one site (``reads_at``/``read``: each row's coefficient ``strength *
    (clip(a, lo, hi) - a)`` per slot, kept for the step) and writes at ``mlp_out`` of its source layer
    and of each later layer it decodes to (``coefficient * write``, before that site's own writes).

    Edits, gates and router biases are ``steering.edit_tables``' (``edits``): a site with one runs on
    its own; after a ``When`` gate every lookup reads each token's row from where the gate moved it."""

    def __init__(self, tables: SteeringTables, plan: SteeringPlan, index: torch.Tensor, views: Any = None):
        self.tables = tables
        self.add_sites = plan.add_sites
        self.clamp_sites = plan.clamp_sites
        self.index = index  # int64 [T_padded] on the device
        self.edits = tables.edits.step_view(plan.edits, index, views) if plan.edits else None
        self.read_sites = plan.tclamp_sites
        self._sources: dict[int, list[Site]] = {}  # output layer -> the read sites whose clamps write there
        for site in plan.tclamp_sites:
            if site in tables.tclamp_write:  # another pipeline stage's layers are not this worker's
                for t in range(tables.tclamp_write[site].shape[2]):
                    self._sources.setdefault(site[1] + t, []).append(site)
        self._coefficients: dict[Site, torch.Tensor] = {}  # read site -> float32 [T, slots]

    def acts_at(self, site: Site) -> bool:
        return (site in self.add_sites or site in self.clamp_sites
                or (site[0] == MLP_OUT and site[1] in self._sources)
                or (self.edits is not None and self.edits.acts_at(site)))

    @property
    def gated(self) -> bool:
        """Gates move tokens between rows this step: a pipeline stage hands the rows on (``index_out``)."""
        return self.edits is not None and self.edits.gated

    def receive_index(self) -> torch.Tensor:
        return self.edits.receive_index()

    def index_out(self) -> torch.Tensor:
        return self.edits.index_out()

    def _index(self, site: Site) -> torch.Tensor:
        """Each token's row for the lookups at ``site`` (after the gates before it)."""
        return self.index if self.edits is None else self.edits.index_for(site)

    def reads_at(self, site: Site) -> bool:
        """Whether transcoder clamps read their feature at ``site`` (after the site's writes)."""
        return site in self.read_sites

    def read(self, site: Site, hidden: torch.Tensor) -> None:
        """Each row's coefficients of the transcoder clamps reading at ``site``: ``a = p if p >
        threshold else 0`` for ``p = h·e + bias``, then ``strength * (clip(factor * a, lo, hi) - a)``."""
        tables, index = self.tables, self._index(site)[:hidden.shape[0]]
        e = tables.tclamp_dir[site].index_select(0, index).float()  # [T, slots, H]
        bounds = tables.tclamp_bounds[site].index_select(0, index)
        gate = tables.tclamp_gate[site].index_select(0, index)
        p = torch.bmm(e, hidden.float().unsqueeze(-1)).squeeze(-1) + gate[..., 0]
        p = torch.where(p > gate[..., 1], p, torch.zeros_like(p))
        target = torch.minimum(torch.maximum(bounds[..., 3] * p, bounds[..., 0]), bounds[..., 1])
        self._coefficients[site] = bounds[..., 2] * (target - p)

    def site_write(self, site: Site) -> SiteWrite | None:
        """None where the site has more than adds and clamps (edits, gates): it runs on its own."""
        if self.edits is not None and self.edits.acts_at(site):
            return None
        return self._write(site)

    def _write(self, site: Site) -> SiteWrite:
        tables = self.tables
        clamped = site in self.clamp_sites
        return SiteWrite(self._index(site), tables.add[site] if site in self.add_sites else None,
                         tables.clamp_dir[site] if clamped else None, tables.clamp_bounds[site] if clamped else None,
                         tables.clamp_write.get(site) if clamped else None,
                         tables.clamp_gate.get(site) if clamped else None)

    def apply(self, site: Site, hidden: torch.Tensor) -> torch.Tensor:
        """The writes at ``site`` alone: its gates read first; then transcoder clamps' writes (at
        ``mlp_out``); then the site's adds and clamps, in one kernel on the fused path (the same
        arithmetic the fused norm does), else the PyTorch ops; then its edits."""
        edits = self.edits
        if edits is not None:
            edits.read_gates(site, hidden)
        if site[0] == MLP_OUT and site[1] in self._sources:
            hidden = self._transcoder_writes(site[1], hidden)
        if site in self.add_sites or site in self.clamp_sites:
            hidden = self._add_and_clamp(site, hidden)
        return hidden if edits is None else edits.apply(site, hidden)

    def _add_and_clamp(self, site: Site, hidden: torch.Tensor) -> torch.Tensor:
        write = self._write(site)
        if fused.enabled(hidden):
            return fused.steer(hidden, write)
        if write.add is not None:
            hidden = add_rows(hidden, write.add, write.index)
        if write.clamp_dir is not None:
            bounds = write.clamp_bounds
            hidden = clamp_rows(hidden, write.clamp_dir, bounds[..., 0], bounds[..., 1], bounds[..., 2], write.index,
                                write.clamp_write, write.clamp_gate, bounds[..., 3])
        return hidden

    def _transcoder_writes(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``h += sum_k c_k * write_k`` (float32) for the transcoder clamps that write at ``mlp_out`` of
        ``layer``, with the coefficients their reads left. A row without one adds exact zeros."""
        index = self._index((MLP_OUT, layer))[:hidden.shape[0]]
        out = hidden.float()
        for site in self._sources[layer]:
            write = self.tables.tclamp_write[site][:, :, layer - site[1]].index_select(0, index).float()
            out = out + torch.bmm(self._coefficients[site].unsqueeze(1), write).squeeze(1)
        return out.to(hidden.dtype)
