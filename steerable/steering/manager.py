"""The steering plane: control (global spec, named modules), admission (compose and validate a
request's effective config), rows (one table row per distinct set of interventions active on a
token) and the per-step index that the hook points read.

Composition is additive: effective = global + module * scale + inline, snapshotted when a request
is admitted, so later changes to the global spec or to modules never alter a running request (and
its KV cache stays consistent). Rows are shared by requests with equal configs, refcounted, and
freed when the last request holding them finishes; tables grow by doubling, so there is no cap on
distinct configs other than memory.
"""

from __future__ import annotations

from steerable.errors import InvalidRequestError
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.engine.request import Request
from steerable.hook_points import RESIDUAL_POINTS
from steerable.selection import SelectSpec
from steerable.steering.ops import add_rows, clamp_rows
from steerable.steering.spec import Intervention, SpecParser, config_identity

Site = tuple[str, int]

# Selection fields that never change which generation rows are selected: a config whose selects
# use only these resolves every decode token of a request to the same row.
_GENERATION_UNIFORM_FIELDS = {"prompt", "prompt_positions", "prompt_window", "prompt_tokens", "generation",
                              "exclude_prompt", "exclude_prompt_positions", "exclude_prompt_window",
                              "exclude_prompt_tokens", "exclude_generation"}


@dataclass
class ConfigEntry:
    """A composed config shared by every live request with the same identity."""

    identity: bytes
    interventions: list[Intervention]
    selects: list[SelectSpec]  # distinct selections; bit g of a pattern = selects[g] matched
    requires: list[int]  # per intervention: bit it needs, or -1 when unselective
    generation_uniform: bool
    reads_generated_tokens: bool
    rows: dict[int, int] = field(default_factory=dict)  # pattern -> row
    refcount: int = 0

    def active(self, pattern: int) -> list[Intervention]:
        return [item for item, bit in zip(self.interventions, self.requires) if bit < 0 or pattern >> bit & 1]


@dataclass
class RequestSteering:
    config: ConfigEntry
    rows: set[int] = field(default_factory=set)
    fixed_row: int | None = None  # the row of every token (a config without selections)
    decode_row: int | None = None  # the row of every generated token, when selections allow


@dataclass
class StepSteering:
    """Per-step view read by the hook points; the runner puts ``host_index`` on the device."""

    host_index: np.ndarray  # int64 [T] row per token
    add_sites: frozenset[Site]  # sites with a live additive row
    clamp_sites: frozenset[Site]  # sites with a live clamp row
    version: int  # of the tables: a CUDA graph captured under another version is stale
    index: torch.Tensor | None = None  # int64 [T_padded] on the device

    @property
    def signature(self) -> tuple:
        """What a CUDA graph bakes in: which op runs at which site, and where the tables live."""
        return self.add_sites, self.clamp_sites, self.version


class SteeringTables:
    """Per-site device tables indexed by row; row 0 is all zeros (no steering)."""

    def __init__(self, hidden_size: int, device: torch.device, dtype: torch.dtype, capacity: int = 64):
        self.hidden_size = hidden_size
        self.device = device
        self.dtype = dtype
        self.capacity = capacity
        self.add: dict[Site, torch.Tensor] = {}
        self.clamp_dir: dict[Site, torch.Tensor] = {}
        self.clamp_lo: dict[Site, torch.Tensor] = {}
        self.clamp_hi: dict[Site, torch.Tensor] = {}
        self.clamp_strength: dict[Site, torch.Tensor] = {}
        self.add_rows: dict[Site, set[int]] = {}
        self.clamp_rows: dict[Site, set[int]] = {}
        # Additive rows written or cleared since the last flush: site -> row -> float32 vector
        # (None: zeros). Sent up once per step rather than one copy per (row, site).
        self._pending: dict[Site, dict[int, torch.Tensor | None]] = {}
        self.version = 0  # bumps whenever a tensor is reallocated (graphs must be re-captured)

    def live_sites(self) -> tuple[frozenset[Site], frozenset[Site]]:
        """(sites with a live additive row, sites with a live clamp row)."""
        return (frozenset(s for s, rows in self.add_rows.items() if rows),
                frozenset(s for s, rows in self.clamp_rows.items() if rows))

    def grow(self, min_capacity: int) -> None:
        capacity = self.capacity
        while capacity < min_capacity:
            capacity *= 2
        if capacity == self.capacity:
            return
        fills = ((self.add, 0.0), (self.clamp_dir, 0.0), (self.clamp_lo, -math.inf), (self.clamp_hi, math.inf),
                 (self.clamp_strength, 0.0))
        for tables, fill in fills:
            for site, old in tables.items():
                new = torch.full((capacity, *old.shape[1:]), fill, dtype=old.dtype, device=self.device)
                new[: old.shape[0]] = old
                tables[site] = new
        self.capacity = capacity
        self.version += 1

    def write(self, row: int, items: Sequence[Intervention]) -> None:
        """Fill a row: additive vectors wait for ``flush``; clamps go up now in one pinned,
        non-blocking copy (a blocking copy would wait for the step in flight on the device)."""
        adds: dict[Site, torch.Tensor] = {}
        clamps: dict[Site, list[Intervention]] = {}
        for item in items:
            if item.kind == "add":
                adds[item.site] = adds.get(item.site, 0) + item.vector
            else:
                clamps.setdefault(item.site, []).append(item)
        for site in adds:
            if site not in self.add:
                self.add[site] = torch.zeros(self.capacity, self.hidden_size, dtype=self.dtype, device=self.device)
                self.version += 1
        for site, vector in adds.items():
            self._pending.setdefault(site, {})[row] = vector
            self.add_rows.setdefault(site, set()).add(row)
        for site, group in clamps.items():
            self._ensure_clamp_slots(site, len(group))
        if not clamps:
            return
        staged = self._upload(torch.stack([item.vector for group in clamps.values() for item in group]).to(self.dtype))
        j = 0
        for site, group in clamps.items():
            for k, item in enumerate(group):
                self.clamp_dir[site][row, k].copy_(staged[j])
                self.clamp_lo[site][row, k] = item.lo
                self.clamp_hi[site][row, k] = item.hi
                self.clamp_strength[site][row, k] = item.strength
                j += 1
            self.clamp_rows.setdefault(site, set()).add(row)

    def flush(self) -> None:
        """Apply the pending additive rows: one pinned upload and one scatter per site."""
        if not self._pending:
            return
        zeros = torch.zeros(self.hidden_size)
        rows = [row for entries in self._pending.values() for row in entries]
        values = [zeros if v is None else v for entries in self._pending.values() for v in entries.values()]
        staged_rows = self._upload(torch.tensor(rows, dtype=torch.int64))
        staged_values = self._upload(torch.stack(values).to(self.dtype))
        start = 0
        for site, entries in self._pending.items():
            end = start + len(entries)
            self.add[site].index_copy_(0, staged_rows[start:end], staged_values[start:end])
            start = end
        self._pending.clear()

    def _upload(self, values: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return values
        return values.pin_memory().to(self.device, non_blocking=True)

    def _ensure_clamp_slots(self, site: Site, slots: int) -> None:
        have = self.clamp_dir[site].shape[1] if site in self.clamp_dir else 0
        if have >= slots:
            return
        shapes = {"dir": (self.capacity, slots, self.hidden_size), "scalar": (self.capacity, slots)}
        new_dir = torch.zeros(shapes["dir"], dtype=self.dtype, device=self.device)
        new_lo = torch.full(shapes["scalar"], -math.inf, device=self.device)
        new_hi = torch.full(shapes["scalar"], math.inf, device=self.device)
        new_strength = torch.zeros(shapes["scalar"], device=self.device)
        if have:
            new_dir[:, :have] = self.clamp_dir[site]
            new_lo[:, :have] = self.clamp_lo[site]
            new_hi[:, :have] = self.clamp_hi[site]
            new_strength[:, :have] = self.clamp_strength[site]
        self.clamp_dir[site], self.clamp_lo[site] = new_dir, new_lo
        self.clamp_hi[site], self.clamp_strength[site] = new_hi, new_strength
        self.version += 1

    def clear(self, row: int) -> None:
        for site, rows in self.add_rows.items():
            if row in rows:
                self._pending.setdefault(site, {})[row] = None
                rows.discard(row)
        for site, rows in self.clamp_rows.items():
            if row in rows:
                self.clamp_dir[site][row] = 0
                self.clamp_lo[site][row] = -math.inf
                self.clamp_hi[site][row] = math.inf
                self.clamp_strength[site][row] = 0
                rows.discard(row)


class SteeringManager:
    def __init__(self, hidden_size: int, num_layers: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int = 256):
        self.parser = SpecParser(hidden_size, num_layers)
        self.num_layers = num_layers
        self.global_items: list[Intervention] = []
        self.modules: dict[str, list[Intervention]] = {}
        self._scaled_modules: dict[tuple[str, float], list[Intervention]] = {}
        self.configs: dict[bytes, ConfigEntry] = {}
        # Room for a tiered config per running request before the first growth: growing moves the
        # tables, which retires every CUDA graph that reads them.
        self.tables = SteeringTables(hidden_size, device, dtype, capacity=2 * max_num_seqs + 1)
        self.row_refs: dict[int, int] = {}
        self.row_owner: dict[int, tuple[bytes, int]] = {}
        self._free_rows: list[int] = []
        self._next_row = 1

    # ------------------------------------------------------------ control plane

    def set_global(self, spec: Any, replace: bool = True) -> None:
        items = self.parser.parse(spec, "steering")
        self.global_items = items if replace else self.global_items + items

    def clear_global(self) -> None:
        self.global_items = []

    def register_modules(self, modules: Mapping[str, Any]) -> None:
        if not isinstance(modules, Mapping):
            raise InvalidRequestError(f"modules: expected {{name: spec}}, got {type(modules).__name__}")
        parsed = {}
        for name, spec in modules.items():
            if not isinstance(name, str) or not name:
                raise InvalidRequestError(f"modules: module names must be non-empty strings, got {name!r}")
            parsed[name] = self.parser.parse(spec, f"modules[{name!r}]")
        self.modules.update(parsed)
        self._scaled_modules.clear()

    def unregister_modules(self, names: Sequence[str]) -> None:
        """Running requests keep the snapshot they were admitted with; new ones can no longer use it."""
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in self.modules]
        if unknown:
            raise InvalidRequestError(f"modules: unknown module(s) {unknown}; registered: {sorted(self.modules)}")
        for name in names:
            del self.modules[name]
        self._scaled_modules.clear()

    def steerable_layers(self) -> dict[str, list[int]]:
        return {point: list(range(self.num_layers)) for point in RESIDUAL_POINTS}

    def status(self) -> dict[str, Any]:
        def summary(items: list[Intervention]) -> dict[str, Any]:
            return {"interventions": len(items), "adds": sum(i.kind == "add" for i in items),
                    "clamps": sum(i.kind == "clamp" for i in items),
                    "sites": sorted({f"{i.point}:{i.layer}" for i in items})}

        return {
            "global": summary(self.global_items),
            "modules": {name: summary(items) for name, items in self.modules.items()},
            "configs_in_use": len(self.configs),
            "rows_in_use": len(self.row_refs),
            "row_capacity": self.tables.capacity,
            "active_sites": sorted(f"{p}:{l}" for p, l in frozenset().union(*self.tables.live_sites())),
        }

    # ------------------------------------------------------------ admission

    def admit(self, request: Request) -> None:
        """Compose and validate the request's steering; sets ``request.steering`` and its cache keys.
        Raises ValueError before changing any state."""
        params = request.params
        items = list(self.global_items)
        ref = params.steering_module_ref
        if ref is not None:
            name, scale = (ref, 1.0) if isinstance(ref, str) else (ref[0], float(ref[1]))
            if name not in self.modules:
                raise InvalidRequestError(f"steering_module_ref: unknown module {name!r}; registered: {sorted(self.modules)}")
            scaled = self._scaled_modules.get((name, scale))
            if scaled is None:  # cached: equal refs share intervention objects and their digests
                scaled = [item.scaled(scale, "steering_module_ref") for item in self.modules[name]]
                self._scaled_modules[(name, scale)] = scaled
            items += scaled
        items += self.parser.parse(params.steering_vectors, "steering_vectors")
        items = [item for item in items if not item.is_noop()]
        if not items:
            return
        identity = config_identity(items)
        config = self.configs.get(identity) or self._new_config(identity, items)
        config.refcount += 1
        self.configs[identity] = config
        request.steering = RequestSteering(config)
        request.hash_keys.extend(self._cache_keys(items, request.prompt_token_ids))

    @staticmethod
    def _new_config(identity: bytes, items: list[Intervention]) -> ConfigEntry:
        selects: list[SelectSpec] = []
        requires = []
        for item in items:
            if item.select is None:
                requires.append(-1)
                continue
            if item.select not in selects:
                selects.append(item.select)
            requires.append(selects.index(item.select))
        uniform = all(set(s.to_wire()) <= _GENERATION_UNIFORM_FIELDS for s in selects)
        return ConfigEntry(identity, items, selects, requires, uniform,
                           any(s.reads_generated_tokens for s in selects))

    @staticmethod
    def _cache_keys(items: list[Intervention], prompt: list[int]) -> list[tuple[int, bytes]]:
        """Prompt blocks carry the identity of the steering that touches prompt rows (from the first
        steered prompt position); blocks with generated tokens also carry the decode steering."""
        keys = []
        prompt_items, first = [], len(prompt)
        for item in items:
            if item.select is None:
                prompt_items.append(item)
                first = 0
            elif item.select.selects_prompt(prompt):
                prompt_items.append(item)
                first = min(first, item.select.prompt_positions_selected(prompt)[0])
        if prompt_items:
            keys.append((first, b"steer-prefill:" + config_identity(prompt_items)))
        decode_items = [i for i in items if i.select is None or i.select.may_select_generation()]
        if decode_items:
            keys.append((len(prompt), b"steer-decode:" + config_identity(decode_items)))
        return keys

    def release(self, request: Request) -> None:
        """Drop the request's references; rows and configs nobody uses any more are freed."""
        state = request.steering
        if state is None:
            return
        request.steering = None
        for row in state.rows:
            self.row_refs[row] -= 1
            if self.row_refs[row] == 0:
                del self.row_refs[row]
                identity, pattern = self.row_owner.pop(row)
                self.configs[identity].rows.pop(pattern, None)
                self.tables.clear(row)
                self._free_rows.append(row)
        config = state.config
        config.refcount -= 1
        if config.refcount == 0:
            del self.configs[config.identity]

    # ------------------------------------------------------------ per step

    def reads_generated_tokens(self) -> bool:
        """A live config selects generated rows by token id: planning needs sampled tokens on the host."""
        return any(config.reads_generated_tokens for config in self.configs.values())

    def prepare(self, batch: Any) -> None:
        """Resolve every token's row, attach ``batch.steering`` (None when nothing is steered) and
        send the step's new rows to the device ahead of its forward."""
        batch.steering = self._step_rows(batch)
        self.tables.flush()

    def _step_rows(self, batch: Any) -> StepSteering | None:
        scheduled = batch.scheduled
        if not any(s.request.steering is not None for s in scheduled):
            return None
        starts = batch.host_query_start
        if batch.is_decode_only:  # one row per request: the common case, kept lean
            index = np.zeros(batch.num_tokens, dtype=np.int64)
            for i, s in enumerate(scheduled):
                state = s.request.steering
                if state is not None:
                    row = state.fixed_row
                    index[i:i + 1] = row if row is not None else self._rows_for(
                        s.request, state, batch.host_positions[i:i + 1], batch.host_token_ids[i:i + 1])
        else:
            index = np.zeros(batch.num_tokens, dtype=np.int64)
            for i, s in enumerate(scheduled):
                state = s.request.steering
                if state is None:
                    continue
                lo, hi = starts[i], starts[i + 1]
                index[lo:hi] = self._rows_for(s.request, state, batch.host_positions[lo:hi],
                                              batch.host_token_ids[lo:hi])
        if not index.any():
            return None
        return StepSteering(index, *self.tables.live_sites(), self.tables.version)

    def _rows_for(self, request: Request, state: RequestSteering, positions: np.ndarray,
                  token_ids: np.ndarray) -> np.ndarray | int:
        config = state.config
        if not config.selects:
            state.fixed_row = self._acquire(state, 0)
            return state.fixed_row
        prompt_len = request.num_prompt_tokens
        decode_chunk = positions[0] >= prompt_len
        if decode_chunk and config.generation_uniform and state.decode_row is not None:
            return state.decode_row
        pos = torch.from_numpy(positions)
        tok = torch.from_numpy(token_ids)
        patterns = np.zeros(len(positions), dtype=np.int64)
        for bit, select in enumerate(config.selects):
            patterns |= select.mask(pos, prompt_len, tok).numpy().astype(np.int64) << bit
        unique, inverse = np.unique(patterns, return_inverse=True)
        rows = np.array([self._acquire(state, int(p)) for p in unique], dtype=np.int64)
        if decode_chunk and config.generation_uniform and len(unique) == 1:
            state.decode_row = int(rows[0])
        return rows[inverse]

    def _acquire(self, state: RequestSteering, pattern: int) -> int:
        """The row for (config, pattern), allocated on first use; 0 when nothing applies."""
        config = state.config
        row = config.rows.get(pattern)
        if row is None:
            active = config.active(pattern)
            if not active:
                return 0
            row = self._free_rows.pop() if self._free_rows else self._new_row()
            self.tables.write(row, active)
            config.rows[pattern] = row
            self.row_owner[row] = (config.identity, pattern)
            self.row_refs[row] = 0
        if row not in state.rows:
            state.rows.add(row)
            self.row_refs[row] += 1
        return row

    def _new_row(self) -> int:
        row = self._next_row
        self._next_row += 1
        if row >= self.tables.capacity:
            self.tables.grow(row + 1)
        return row

    # ------------------------------------------------------------ data plane (HookPoints writer)

    def acts_at(self, point: str, layer: int, batch: Any) -> bool:
        step = batch.steering
        return step is not None and ((point, layer) in step.add_sites or (point, layer) in step.clamp_sites)

    def table_add(self, point: str, layer: int, batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The site's steering as ``(table, index)`` when it only adds (no clamp row is live there),
        so the fused residual add + norm can apply it."""
        step = batch.steering
        site = (point, layer)
        if site in step.clamp_sites or site not in step.add_sites:
            return None
        return self.tables.add[site], step.index

    def apply(self, point: str, layer: int, hidden: torch.Tensor, batch: Any) -> torch.Tensor:
        step = batch.steering
        if step is None:
            return hidden
        site = (point, layer)
        tables = self.tables
        if site in step.add_sites:
            hidden = add_rows(hidden, tables.add[site], step.index)
        if site in step.clamp_sites:
            hidden = clamp_rows(hidden, tables.clamp_dir[site], tables.clamp_lo[site], tables.clamp_hi[site],
                                tables.clamp_strength[site], step.index)
        return hidden
