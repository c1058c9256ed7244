"""The driver's ledger of the worker's steering tables: which row holds what at which site, how
many rows and clamp slots the tables have, and the changes not yet sent.

Row contents travel to the worker in the next step's ``SteeringUpdate``, all of them in one
message (a row freed and reused within a step sends only its final contents). A freed row keeps
its values on the worker until it is reused: no token reads it meanwhile, and its next write also
clears the sites the new contents leave out, so a request that finishes sends nothing. A change
that makes the worker reallocate a table bumps ``version``: CUDA graphs captured before it are stale.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from steerable.steering.spec import Intervention
from steerable.step import NO_CLAMP, NO_GATE, Site, SteeringUpdate, TableWrite

# read direction, min, max, strength, write direction (None: the read one), bias, threshold, factor;
# a transcoder clamp's write directions are [span, H], one per output layer from its source on.
ClampSlot = tuple[np.ndarray, float, float, float, np.ndarray | None, float, float, float]
RowSites = tuple[list[Site], list[Site], list[Site]]  # (sites of a row's adds, clamps, transcoder clamps)


class RowTables:
    def __init__(self, capacity: int, hidden_size: int):
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.version = 0
        self.add_rows: dict[Site, set[int]] = {}
        self.clamp_rows: dict[Site, set[int]] = {}
        self.clamp_slots: dict[Site, int] = {}
        self.split_sites: set[Site] = set()  # sites whose clamp tables hold write directions and gates
        # Transcoder clamps by the site where they read (the transcoder's input at the source layer):
        # rows, slots, and the span of output layers their write tables cover.
        self.tclamp_rows: dict[Site, set[int]] = {}
        self.tclamp_slots: dict[Site, int] = {}
        self.tclamp_span: dict[Site, int] = {}
        self._tclamps: dict[Site, dict[int, list[ClampSlot]]] = {}
        self._used_tclamp: set[Site] = set()
        self._tplan: frozenset[Site] | None = None
        self._adds: dict[Site, dict[int, np.ndarray | None]] = {}  # None: back to zeros
        self._clamps: dict[Site, dict[int, list[ClampSlot]]] = {}  # []: every slot cleared
        self._row_sites: dict[int, RowSites] = {}  # every live row's sites
        self._stale: dict[int, RowSites] = {}  # freed rows' sites, whose old values the worker still holds
        self._sent_capacity = 0
        self._live: tuple[frozenset[Site], frozenset[Site]] | None = None  # cached until rows change
        # Sites used since the tables were last idle (see plan_sites), and their cached frozensets.
        self._used_add: set[Site] = set()
        self._used_clamp: set[Site] = set()
        self._plan: tuple[frozenset[Site], frozenset[Site]] | None = None

    def live_sites(self) -> tuple[frozenset[Site], frozenset[Site]]:
        """(sites with a live additive row, sites with a live clamp row): the same objects from step
        to step while no row changes, so a CUDA-graph key built from them hashes once."""
        if self._live is None:
            self._live = (frozenset(s for s, rows in self.add_rows.items() if rows),
                          frozenset(s for s, rows in self.clamp_rows.items() if rows))
        return self._live

    def plan_sites(self) -> tuple[frozenset[Site], frozenset[Site]]:
        """(sites an additive row used, sites a clamp row used) since no row was last live: what a
        step applies, and what its CUDA-graph key says. A site stays in while any row anywhere lives,
        after its own rows are freed (its tables then hold only zero rows, which change nothing), so
        the graph keys do not change each time the last request of one config finishes, which would
        capture new graphs for every batch size of a workload's tail. The same objects from step to
        step while the sets do not change: the key hashes once."""
        if self._plan is None:
            self._plan = (frozenset(self._used_add), frozenset(self._used_clamp))
        return self._plan

    def plan_tclamp_sites(self) -> frozenset[Site]:
        """As ``plan_sites``, for transcoder clamps (by the site where they read)."""
        if self._tplan is None:
            self._tplan = frozenset(self._used_tclamp)
        return self._tplan

    def grow(self, min_capacity: int) -> None:
        capacity = self.capacity
        while capacity < min_capacity:
            capacity *= 2
        if capacity != self.capacity:
            self.capacity = capacity
            self.version += 1

    def write(self, row: int, items: Sequence[Intervention]) -> None:
        """Fill ``row`` (a new or freed one) with the interventions active on its tokens (adds at
        one site are summed); sites its old contents held and these do not are cleared. Vectors
        are kept as views until the update packs them (a config's one vector given at many layers
        is one tensor: it is viewed once)."""
        self._live = None
        adds: dict[Site, np.ndarray] = {}
        clamps: dict[Site, list[ClampSlot]] = {}
        tclamps: dict[Site, list[ClampSlot]] = {}
        arrays: dict[int, np.ndarray] = {}
        for item in items:
            site = item.point, item.layer
            vector = arrays.get(id(item.vector))
            if vector is None:
                vector = arrays[id(item.vector)] = item.vector.numpy()
            if item.kind == "add":
                have = adds.get(site)
                adds[site] = vector if have is None else have + vector
            elif item.kind == "tclamp":
                tclamps.setdefault(site, []).append((vector, item.lo, item.hi, item.strength, item.write.numpy(),
                                                     item.bias, item.threshold, item.factor))
            else:
                write = None if item.write is None else item.write.numpy()
                clamps.setdefault(site, []).append((vector, item.lo, item.hi, item.strength, write, item.bias,
                                                    item.threshold, item.factor))
        stale_adds, stale_clamps, stale_tclamps = self._stale.pop(row, ((), (), ()))
        for site in stale_adds:
            if site not in adds:
                self._adds.setdefault(site, {})[row] = None
        for site in stale_clamps:
            if site not in clamps:
                self._clamps.setdefault(site, {})[row] = []
        for site in stale_tclamps:
            if site not in tclamps:
                self._tclamps.setdefault(site, {})[row] = []
        for site in adds.keys() - self.add_rows.keys():
            self.add_rows[site] = set()
            self.version += 1  # a new table
        for site, vector in adds.items():
            pending = self._adds.get(site)
            if pending is None:
                pending = self._adds[site] = {}
            pending[row] = vector
            self.add_rows[site].add(row)
        if not self._used_add.issuperset(adds):
            self._used_add.update(adds)
            self._plan = None
        for site, slots in clamps.items():
            if len(slots) > self.clamp_slots.get(site, 0):
                self.clamp_slots[site] = len(slots)
                self.version += 1  # the site's clamp tables are reallocated wider
            if site not in self.split_sites and any(slot[4] is not None for slot in slots):
                self.split_sites.add(site)
                self.version += 1  # the site gains write-direction and gate tables
            pending = self._clamps.get(site)
            if pending is None:
                pending = self._clamps[site] = {}
            pending[row] = slots
            self.clamp_rows.setdefault(site, set()).add(row)
        if not self._used_clamp.issuperset(clamps):
            self._used_clamp.update(clamps)
            self._plan = None
        self._write_tclamps(row, tclamps)
        self._row_sites[row] = (list(adds), list(clamps), list(tclamps))

    def _write_tclamps(self, row: int, tclamps: dict[Site, list[ClampSlot]]) -> None:
        for site, slots in tclamps.items():
            span = max(len(slot[4]) for slot in slots)
            if len(slots) > self.tclamp_slots.get(site, 0) or span > self.tclamp_span.get(site, 0):
                self.tclamp_slots[site] = max(len(slots), self.tclamp_slots.get(site, 0))
                self.tclamp_span[site] = max(span, self.tclamp_span.get(site, 0))
                self.version += 1  # the site's tables are reallocated wider
            self._tclamps.setdefault(site, {})[row] = slots
            self.tclamp_rows.setdefault(site, set()).add(row)
        if not self._used_tclamp.issuperset(tclamps):
            self._used_tclamp.update(tclamps)
            self._tplan = None

    def clear(self, row: int) -> None:
        """``row`` is free: nothing is sent now (see the module docstring), its sites are noted."""
        sites = self._row_sites.pop(row, None)
        if sites is None:
            return
        self._live = None
        for site in sites[0]:
            self.add_rows[site].discard(row)
        for site in sites[1]:
            self.clamp_rows[site].discard(row)
        for site in sites[2]:
            self.tclamp_rows[site].discard(row)
        self._stale[row] = sites
        if not self._row_sites:
            self._used_add.clear()
            self._used_clamp.clear()
            self._used_tclamp.clear()
            self._plan = self._tplan = None

    def take_update(self) -> SteeringUpdate | None:
        """Everything changed since the last call (None when nothing did), packed in one buffer with
        one numpy op per part (row indices, vector indices, params, vectors) rather than one per
        site; each vector array once (``write`` keeps one per tensor of a row, whatever its layers)."""
        if not self._adds and not self._clamps and not self._tclamps and self.capacity == self._sent_capacity:
            return None
        hidden = self.hidden_size
        zeros = np.zeros(hidden, dtype=np.float32)
        writes, row_ids, params, pieces = [], [], [], []
        for site, rows in self._adds.items():
            writes.append(TableWrite("add", *site, len(row_ids), len(rows), len(pieces)))
            row_ids += rows
            pieces += [zeros if v is None else v for v in rows.values()]
        for site, rows in self._clamps.items():
            slots, split = self.clamp_slots[site], site in self.split_sites
            writes.append(TableWrite("clamp", *site, len(row_ids), len(rows), len(pieces), len(params), slots, split))
            row_ids += rows
            _pack_clamps(list(rows.values()), slots, split, pieces, params, zeros)
        for site, rows in self._tclamps.items():
            slots, span = self.tclamp_slots[site], self.tclamp_span[site]
            writes.append(TableWrite("tclamp", *site, len(row_ids), len(rows), len(pieces), len(params), slots,
                                     True, span))
            row_ids += rows
            _pack_tclamps(list(rows.values()), slots, span, pieces, params, zeros)
        distinct: dict[int, int] = {}  # id of an array -> its index among the vectors sent
        piece_ids = [distinct.setdefault(id(piece), len(distinct)) for piece in pieces]
        vectors = list({id(piece): piece for piece in pieces}.values())  # first seen first, as numbered
        num_rows, num_pieces, num_params = len(row_ids), len(piece_ids), len(params)
        params_at = num_rows + num_pieces
        data = np.empty(params_at + num_params + len(vectors) * hidden, dtype=np.float32)
        data[:num_rows].view(np.int32)[:] = row_ids
        data[num_rows:params_at].view(np.int32)[:] = piece_ids
        data[params_at:params_at + num_params] = params
        if vectors:
            np.stack(vectors, out=data[params_at + num_params:].reshape(len(vectors), hidden))
        self._adds, self._clamps, self._tclamps = {}, {}, {}
        self._sent_capacity = self.capacity
        return SteeringUpdate(self.capacity, hidden, data, writes, num_rows, num_pieces, num_params)


def _pack_clamps(rows: list[list[ClampSlot]], width: int, split: bool, pieces: list[np.ndarray],
                 params: list[float], zeros: np.ndarray) -> None:
    """Appends rows' slots at every slot of the table's width (``TableWrite``'s layout): read
    directions, then write directions, to ``pieces``; bounds (lo, hi, strength, factor), then gates,
    to ``params``. A slot a row leaves unused reads and writes zeros with ``NO_CLAMP`` and ``NO_GATE``."""
    slots = [row[k] if k < len(row) else None for row in rows for k in range(width)]
    pieces += [zeros if s is None else s[0] for s in slots]
    for s in slots:
        params += NO_CLAMP if s is None else (*s[1:4], s[7])
    if split:
        pieces += [zeros if s is None else s[0] if s[4] is None else s[4] for s in slots]
        for s in slots:
            params += NO_GATE if s is None else s[5:7]


def _pack_tclamps(rows: list[list[ClampSlot]], width: int, span: int, pieces: list[np.ndarray],
                  params: list[float], zeros: np.ndarray) -> None:
    """As ``_pack_clamps`` with write directions and gates, each slot's writes as ``span`` vectors
    (one per output layer from the source on; zeros past the slot's own span)."""
    slots = [row[k] if k < len(row) else None for row in rows for k in range(width)]
    pieces += [zeros if s is None else s[0] for s in slots]
    for s in slots:
        params += NO_CLAMP if s is None else (*s[1:4], s[7])
    for s in slots:
        written = [] if s is None else list(s[4])
        pieces += written + [zeros] * (span - len(written))
    for s in slots:
        params += NO_GATE if s is None else s[5:7]
