"""The driver's ledger of the worker's edit tables (``steering.edit_tables``): what each steering row
holds at each site for low-rank and dense edits, ``When`` gates and router biases, the tables'
widths, and the changes not yet sent. ``steering.rows`` keeps the add and clamp tables the same way
(freed rows keep their values until reused; a reuse clears the sites the new contents leave out).

Per site and row, the tables hold (``EditWrite.arrays`` in this order):

- "edit": ``V`` [R, H], ``U`` [R, H], ``b`` [R] and ``c`` [H] for ``h += U^T (V h + b) + c`` (the
  row's low-rank edits there concatenated, zero-padded to the site's rank ``R``), and the row's
  dense slot (0: none); "dense": the site's ``A`` [H, H] by slot, ``h += A[slot] h``. A row whose
  rank at a site exceeds ``MAX_TABLE_RANK`` is folded into a dense slot (``U^T V`` and ``U^T b``):
  the table's width is the widest row's, so one wide row would widen every row.
- "gate": per slot the direction read [K, H], its params [K, 4] (bias, floor, threshold, sign), its
  mode [K] (``steering.gating``), and the row each outcome code leads to [2^K].
- "router": the bias of each expert [E].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from steerable.steering.gating import GateSlots
from steerable.steering.spec import Intervention
from steerable.step import EditSites, EditWrite, Site

MAX_TABLE_RANK = 64
TABLES = ("edit", "gate", "router")
Content = tuple  # a row's payload at one site, per table (see the module docstring)


class EditRows:
    def __init__(self, hidden_size: int):
        self.hidden_size = hidden_size
        self.version = 0
        self.width: dict[tuple[str, Site], int] = {}  # (table, site) -> rank R, gate slots K or experts E
        self.dense_slots: dict[Site, int] = {}  # slots of each site's dense table (slot 0 stays zero)
        self._dense_free: dict[Site, list[int]] = {}
        self._row_dense: dict[tuple[int, Site], int] = {}  # (row, site) -> its dense slot
        self._pending: dict[tuple[str, Site], dict[int, Content | None]] = {}  # None: back to "nothing"
        self._dense_pending: dict[Site, dict[int, np.ndarray]] = {}
        self._row_sites: dict[int, list[tuple[str, Site]]] = {}
        self._stale: dict[int, list[tuple[str, Site]]] = {}
        self._prompt_gates: set[Site] = set()
        self._used: set[tuple[str, Site]] = set()
        self._plan: EditSites | None = None

    @property
    def live(self) -> bool:
        return bool(self._row_sites)

    def plan_sites(self) -> EditSites | None:
        """The sites a step runs each op at: those used since no row was last live (as
        ``RowTables.plan_sites``, so CUDA-graph keys stay put while configs come and go)."""
        if self._plan is None and self._used:
            sites = {table: frozenset(s for t, s in self._used if t == table) for table in TABLES}
            self._plan = EditSites(sites["edit"], sites["gate"], frozenset(self._prompt_gates), sites["router"])
        return self._plan

    def write(self, row: int, items: Sequence[Intervention], gates: Sequence[GateSlots]) -> None:
        """Fill ``row`` (new or freed) with its edit items and gate slots."""
        contents: dict[tuple[str, Site], Content] = {}
        for site, parts in _by_site(items, ("lowrank", "dense")).items():
            contents["edit", site] = self._edit(row, site, parts)
        for site, parts in _by_site(items, ("router",)).items():
            contents["router", site] = (sum(item.vector.numpy() for item in parts),)
        for site, slots, rows in gates:
            contents["gate", site] = (slots, rows)
            if any(gate.scope == "prompt" for gate, _ in slots) and site not in self._prompt_gates:
                self._prompt_gates.add(site)
                self._plan = None
        for key in self._stale.pop(row, ()):
            if key not in contents:
                self._pending.setdefault(key, {})[row] = None
        for key, content in contents.items():
            self._grow(key, content)
            self._pending.setdefault(key, {})[row] = content
        if not self._used.issuperset(contents):
            self._used.update(contents)
            self._plan = None
        if contents:
            self._row_sites[row] = list(contents)

    def clear(self, row: int) -> None:
        """``row`` is free: its dense slots go back to their sites' free lists; nothing is sent."""
        keys = self._row_sites.pop(row, None)
        if keys is None:
            return
        for table, site in keys:
            slot = self._row_dense.pop((row, site), None)
            if slot is not None:
                self._dense_free.setdefault(site, []).append(slot)
        self._stale[row] = keys
        if not self._row_sites:
            self._used.clear()
            self._prompt_gates.clear()
            self._plan = None

    def take_update(self) -> list[EditWrite]:
        writes = [self._dense_write(site, slots) for site, slots in self._dense_pending.items()]
        for (table, site), rows in self._pending.items():
            writes.append(self._pack(table, site, rows))
        self._pending, self._dense_pending = {}, {}
        return writes

    # ------------------------------------------------------------ internals

    def _edit(self, row: int, site: Site, parts: list[Intervention]) -> Content:
        """The row's low-rank parts at ``site`` concatenated, constants summed, dense parts summed
        into one matrix (with the low-rank ones when they are too wide), and its dense slot."""
        hidden = self.hidden_size
        c = np.zeros(hidden, np.float32)
        dense = None
        lowrank = [item for item in parts if item.kind == "lowrank"]
        for item in parts:
            c = c + item.vector.numpy()
            if item.kind == "dense":
                A = item.matrices[0].numpy()
                dense = A if dense is None else dense + A
        V, b, U = (np.concatenate([item.matrices[part].numpy() for item in lowrank]) if lowrank
                   else np.zeros((0, hidden) if part != 1 else 0, np.float32) for part in range(3))
        if len(V) > MAX_TABLE_RANK:
            folded = U.T @ V
            dense = folded if dense is None else dense + folded
            c = c + U.T @ b
            V, b, U = V[:0], b[:0], U[:0]
        slot = self._row_dense.pop((row, site), 0)
        if dense is None and slot:
            self._dense_free.setdefault(site, []).append(slot)
            slot = 0
        if dense is not None:
            if not slot:
                free = self._dense_free.get(site)
                slot = free.pop() if free else self.dense_slots.get(site, 1)
                if slot >= self.dense_slots.get(site, 1):
                    self.dense_slots[site] = slot + 1
                    self.version += 1  # the site's dense table is reallocated
            self._row_dense[row, site] = slot
            self._dense_pending.setdefault(site, {})[slot] = dense.astype(np.float32)
        return V, U, b, c, slot

    def _grow(self, key: tuple[str, Site], content: Content) -> None:
        """Widen the table to the content (its first part: the rank's rows, the gate slots, the experts)."""
        need = len(content[0])
        have = self.width.get(key)
        if have is None or need > have:
            self.width[key] = max(need, have or 0)
            self.version += 1  # a new table, or one reallocated wider

    def _dense_write(self, site: Site, slots: dict[int, np.ndarray]) -> EditWrite:
        return EditWrite("dense", *site, np.fromiter(slots, np.int64, len(slots)), self.dense_slots[site],
                         [np.stack(list(slots.values()))])

    def _pack(self, table: str, site: Site, rows: dict[int, Content | None]) -> EditWrite:
        """Every row at the table's current width, zeros (or a gate's "stay") where it has less."""
        width, n, hidden = self.width[table, site], len(rows), self.hidden_size
        ids = np.fromiter(rows, np.int64, n)
        if table == "router":
            bias = np.zeros((n, width), np.float32)
            for i, content in enumerate(rows.values()):
                if content is not None:
                    bias[i] = content[0]
            return EditWrite("router", *site, ids, width, [bias])
        if table == "edit":
            V, U = np.zeros((n, width, hidden), np.float32), np.zeros((n, width, hidden), np.float32)
            b, c, slots = np.zeros((n, width), np.float32), np.zeros((n, hidden), np.float32), np.zeros(n, np.int64)
            for i, content in enumerate(rows.values()):
                if content is not None:
                    r = len(content[0])
                    V[i, :r], U[i, :r], b[i, :r], c[i], slots[i] = content
            return EditWrite("edit", *site, ids, width, [V, U, b, c, slots])
        read = np.zeros((n, width, hidden), np.float32)
        params = np.zeros((n, width, 4), np.float32)
        mode = np.zeros((n, width), np.int64)
        moves = np.repeat(ids[:, None], 1 << width, axis=1)  # a row without the slot stays where it is
        for i, content in enumerate(rows.values()):
            if content is None:
                continue
            slots, targets = content
            for k, (gate, slot_mode) in enumerate(slots):
                read[i, k] = gate.read.numpy()
                params[i, k] = gate.bias, gate.floor, gate.threshold, gate.sign
                mode[i, k] = slot_mode
            moves[i, :len(targets)] = targets
        return EditWrite("gate", *site, ids, width, [read, params, mode, moves])


def _by_site(items: Sequence[Intervention], kinds: tuple[str, ...]) -> dict[Site, list[Intervention]]:
    out: dict[Site, list[Intervention]] = {}
    for item in items:
        if item.kind in kinds:
            out.setdefault(item.site, []).append(item)
    return out
