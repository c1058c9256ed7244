"""The edit tables on the worker (low-rank and dense edits, ``When`` gates, router biases), filled
from the driver's ``EditWrite``s (``steering.edit_rows`` has the layout), and their per-step ops.

Everything is a lookup by each token's steering row with fixed shapes, so a CUDA graph replays it
with new rows and contents; row 0 of every table changes nothing. A low-rank edit runs as two
batched products per token (``~4 r H`` flops a row), all requests' edits at a site at once.

Gates move tokens between rows: a step with gates keeps each token's current row in ``live``
(a persistent buffer), which a gate's hook point rewrites with the row its outcomes lead to
and every lookup after the first gate reads. A pipeline stage hands ``live`` on with the residual
stream. A prompt-scope gate keeps, per request slot, the running sum of its reading over the
prompt (float64) and, once the last prompt row has been read, its decision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from steerable.steering.edits import site_order
from steerable.steering.gating import ACCUMULATE, APPLY, DECIDE, RESET, TOKEN
from steerable.step import EditSites, EditWrite, Site

CHUNK = 2048  # rows per batched product: bounds the gathered [rows, R, H] temporaries of a long prefill


class EditTables:
    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype, owns: Callable[[Site], bool],
                 max_tokens: int, max_seqs: int):
        """``max_tokens``: the most rows a step has (the live-row buffer); ``max_seqs``: request slots."""
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.owns = owns
        self.max_tokens = max_tokens
        self.slots = max_seqs + 2  # request slots, the padding sequences' slot, and a scratch one
        self.capacity = 1
        self.tables: dict[tuple[str, Site], list[torch.Tensor]] = {}  # (table, site) -> its tensors by row
        self.dense: dict[Site, torch.Tensor] = {}  # [D, H, H]
        self.sums: dict[Site, torch.Tensor] = {}  # float64 [slots, K]: a prompt gate's running sum per request
        self.decided: dict[Site, torch.Tensor] = {}  # bool [slots, K]
        self.live: torch.Tensor | None = None

    # ------------------------------------------------------------ updates from the driver

    def grow(self, capacity: int) -> None:
        for key, tensors in self.tables.items():
            self.tables[key] = [self._grown(key[0], i, t, capacity) for i, t in enumerate(tensors)]
        self.capacity = capacity

    def apply(self, writes: list[EditWrite]) -> None:
        """Each write's rows into its site's tables (widened first where the write is wider)."""
        for write in writes:
            if not self.owns(write.site):
                continue
            if write.table == "dense":
                self._write_dense(write)
                continue
            rows = torch.from_numpy(write.rows).to(self.device)
            for table, array in zip(self._ensure(write.table, write.site, write.width), write.arrays):
                table.index_copy_(0, rows, torch.from_numpy(array).to(self.device, table.dtype))

    def _write_dense(self, write: EditWrite) -> None:
        site, hidden = write.site, self.hidden_size
        have = self.dense.get(site)
        if have is None or have.shape[0] < write.width:
            grown = torch.zeros(write.width, hidden, hidden, dtype=self.dtype, device=self.device)
            if have is not None:
                grown[:have.shape[0]] = have
            self.dense[site] = grown
        self.dense[site].index_copy_(0, torch.from_numpy(write.rows).to(self.device),
                                     torch.from_numpy(write.arrays[0]).to(self.device, self.dtype))

    def _ensure(self, table: str, site: Site, width: int) -> list[torch.Tensor]:
        """The site's tensors of ``table``, at least ``width`` wide (wider ones keep their rows)."""
        key = (table, site)
        have = self.tables.get(key)
        if have is not None and have[0].shape[1] >= width:  # each table's first part is [rows, width, ...]
            return have
        fresh = self._fresh(table, width)
        if have is not None:
            old = have[0].shape[1]
            for part, (new, before) in enumerate(zip(fresh, have)):
                if table == "edit" and part >= 3:  # constants and dense slots do not widen
                    new.copy_(before)
                elif table == "gate" and part == 3:  # the rows each outcome code leads to
                    new[:, :1 << old] = before
                else:
                    new[:, :old] = before
        self.tables[key] = fresh
        if table == "gate":
            self._ensure_sums(site, width)
        return fresh

    def _fresh(self, table: str, width: int) -> list[torch.Tensor]:
        cap, hidden, device = self.capacity, self.hidden_size, self.device
        if table == "edit":
            return [torch.zeros(cap, width, hidden, dtype=self.dtype, device=device),
                    torch.zeros(cap, width, hidden, dtype=self.dtype, device=device),
                    torch.zeros(cap, width, device=device), torch.zeros(cap, hidden, dtype=self.dtype, device=device),
                    torch.zeros(cap, dtype=torch.int64, device=device)]
        if table == "router":
            return [torch.zeros(cap, width, device=device)]
        stay = torch.arange(cap, device=device)[:, None].expand(cap, 1 << width).contiguous()
        return [torch.zeros(cap, width, hidden, dtype=self.dtype, device=device),
                torch.zeros(cap, width, 4, device=device), torch.zeros(cap, width, dtype=torch.int64, device=device),
                stay]

    def _grown(self, table: str, part: int, old: torch.Tensor, capacity: int) -> torch.Tensor:
        new = torch.zeros(capacity, *old.shape[1:], dtype=old.dtype, device=old.device)
        if table == "gate" and part == 3:  # new rows stay where they are
            new.copy_(torch.arange(capacity, device=old.device)[:, None].expand_as(new))
        new[:old.shape[0]] = old
        return new

    def _ensure_sums(self, site: Site, width: int) -> None:
        have = self.sums.get(site)
        sums = torch.zeros(self.slots, width, dtype=torch.float64, device=self.device)
        decided = torch.zeros(self.slots, width, dtype=torch.bool, device=self.device)
        if have is not None:
            sums[:, :have.shape[1]] = have
            decided[:, :have.shape[1]] = self.decided[site]
        self.sums[site], self.decided[site] = sums, decided

    # ------------------------------------------------------------ per step

    def step_view(self, sites: EditSites, index: torch.Tensor, views: Any) -> "EditStep":
        if sites.gates and self.live is None:
            self.live = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        return EditStep(self, sites, index, views)


class EditStep:
    """One step's edits: which sites act, the row index each lookup reads, and the ops."""

    def __init__(self, tables: EditTables, sites: EditSites, index: torch.Tensor, views: Any):
        self.tables = tables
        self.sites = sites
        self.index = index
        self.views = views
        self.gated = bool(sites.gates)
        self.live = tables.live[:index.shape[0]] if self.gated else None
        owned = [site_order(*site) for site in sites.gates if tables.owns(site)]
        self.first_gate = min(owned) if owned else None
        self.received = False  # a later pipeline stage: ``live`` came with the residual stream

    def acts_at(self, site: Site) -> bool:
        sites = self.sites
        return site in sites.edit or site in sites.gates or site in sites.router

    def index_for(self, site: Site, after_gates: bool = True) -> torch.Tensor:
        """Each token's row for the lookups at ``site``: ``live`` once a gate has run (``after_gates``:
        this site's own gates included)."""
        if not self.gated:
            return self.index
        if self.received or self.first_gate is not None and (
                site_order(*site) > self.first_gate or after_gates and site_order(*site) == self.first_gate):
            return self.live
        return self.index

    def receive_index(self) -> torch.Tensor:
        """The buffer a later pipeline stage receives the rows into."""
        self.received = True
        return self.live

    def index_out(self) -> torch.Tensor:
        """What this stage hands on: the rows after its gates (or as received), else the step's own.
        A copy: the send completes in the background, while the next micro-batch's step already
        writes both buffers."""
        return (self.live if self.received or self.first_gate is not None else self.index).clone()

    def read_gates(self, site: Site, hidden: torch.Tensor) -> None:
        """Evaluate the gates at ``site`` on ``hidden`` (before the site's writes) and move each
        token to the row its outcomes lead to."""
        if site not in self.sites.gates:
            return
        tables = self.tables
        read, params, mode, moves = tables.tables["gate", site]
        current = self.index_for(site, after_gates=False)
        n = current.shape[0]
        width = read.shape[1]
        p = torch.bmm(read.index_select(0, current).float(), hidden[:n].float().unsqueeze(-1)).squeeze(-1)
        par = params.index_select(0, current)
        p = p + par[..., 0]
        value = torch.where(p > par[..., 1], p, torch.zeros_like(p))
        sign, threshold = par[..., 3], par[..., 2]
        passes = _compare(value, threshold, sign) & (mode.index_select(0, current) & TOKEN != 0)
        if site in self.sites.prompt_gates:
            passes = passes | self._prompt_decisions(site, value.double(), threshold.double(), sign,
                                                     mode.index_select(0, current))
        code = (passes.long() << torch.arange(width, device=p.device)).sum(-1)
        self.live.copy_(moves.view(-1).index_select(0, current * moves.shape[1] + code))

    def _prompt_decisions(self, site: Site, value: torch.Tensor, threshold: torch.Tensor, sign: torch.Tensor,
                          mode: torch.Tensor) -> torch.Tensor:
        """Per request slot: reset the sum on its first prompt row, add every prompt row's value,
        decide on the last one from the mean, and return the decision on generated rows. Rows with
        nothing to do there write to a scratch slot; flat scatters, so a CUDA graph holds them."""
        tables = self.tables
        sums, decided = tables.sums[site].view(-1), tables.decided[site].view(-1)
        width = mode.shape[1]
        cell = self._slots()[:, None] * width + torch.arange(width, device=mode.device)  # [T, K]: slot, column
        scratch = torch.full_like(cell, (tables.slots - 1) * width)
        sums.scatter_(0, torch.where(mode & RESET != 0, cell, scratch).view(-1), 0.0)
        sums.scatter_add_(0, torch.where(mode & ACCUMULATE != 0, cell, scratch).view(-1), value.view(-1))
        count = (self.views.positions[:mode.shape[0]] + 1).double().unsqueeze(-1)
        verdict = _compare(sums.gather(0, cell.view(-1)).view_as(value) / count, threshold, sign)
        decided.scatter_(0, torch.where(mode & DECIDE != 0, cell, scratch).view(-1), verdict.view(-1))
        return decided.gather(0, cell.view(-1)).view_as(verdict) & (mode & APPLY != 0)

    def _slots(self) -> torch.Tensor:
        """Each token's request slot (its sequence's), on the device: computed at every use, so a
        CUDA graph captured on a second run of the step records it too."""
        views = self.views
        starts = views.query_start[1:]
        tokens = torch.arange(self.index.shape[0], device=starts.device, dtype=starts.dtype)
        seq = torch.searchsorted(starts, tokens, right=True).clamp_(max=views.request_slots.shape[0] - 1)
        return views.request_slots.index_select(0, seq)

    def apply(self, site: Site, hidden: torch.Tensor) -> torch.Tensor:
        """The low-rank / dense edits or the router bias at ``site`` (after its adds and clamps)."""
        if site in self.sites.router:
            (bias,) = self.tables.tables["router", site]
            index = self.index_for(site)[:hidden.shape[0]]
            return (hidden.float() + bias.index_select(0, index)).to(hidden.dtype)
        if site not in self.sites.edit:
            return hidden
        V, U, b, c, dense_slot = self.tables.tables["edit", site]
        index = self.index_for(site)[:hidden.shape[0]]
        out = torch.empty_like(hidden)
        dense = self.tables.dense.get(site)
        for start in range(0, hidden.shape[0], CHUNK):
            rows = index[start:start + CHUNK]
            x = hidden[start:start + CHUNK].float()
            delta = c.index_select(0, rows).float()
            if V.shape[1]:
                z = torch.bmm(V.index_select(0, rows).float(), x.unsqueeze(-1)).squeeze(-1) + b.index_select(0, rows)
                delta = delta + torch.bmm(z.unsqueeze(1), U.index_select(0, rows).float()).squeeze(1)
            if dense is not None:
                slot = dense_slot.index_select(0, rows).unsqueeze(-1)
                for j in range(1, dense.shape[0]):
                    delta = delta + torch.where(slot == j, x @ dense[j].float().T, torch.zeros_like(x))
            out[start:start + CHUNK] = (x + delta).to(hidden.dtype)
        return out


def _compare(value: torch.Tensor, threshold: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """``value > threshold`` where sign > 0, ``value < threshold`` where it is < 0; never where 0."""
    return torch.where(sign > 0, value > threshold, (sign < 0) & (value < threshold))
