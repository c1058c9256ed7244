"""The steering plane on the driver: control (global spec, named modules), admission (compose and
validate a request's effective config), rows (one table row per distinct set of interventions
active on a token) and, per step, a plain ``SteeringPlan`` (the row of every token) plus the table
changes the worker applies before the forward (``steering.tables`` holds the device side).

Composition is additive: effective = global + module * scale + inline, snapshotted when a request
is admitted, so later changes to the global spec or to modules never alter a running request (and
its KV cache stays consistent). Rows are shared by requests with equal configs, refcounted, and
freed when the last request holding them finishes; tables grow by doubling, so there is no cap on
distinct configs other than memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.errors import InvalidRequestError
from steerable.hook_points import HOOK_POINTS
from steerable.request import Request, ScheduledRequest
from steerable.sae.registry import SaeRegistry
from steerable.selection import SelectSpec
from steerable.steering.edit_rows import EditRows
from steerable.steering.gating import ConfigGates, config_gates, gate_slots
from steerable.steering.edits import as_user_items
from steerable.steering.rows import RowTables
from steerable.steering.spans import DecodeSpans
from steerable.steering.spec import EDIT_KINDS, Intervention, SpecParser, SteeringSpec, config_identity
from steerable.step import SteeringPlan, SteeringUpdate

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
    gating: ConfigGates | None = None  # its When gates (steering.gating)
    rows: dict[int, int] = field(default_factory=dict)  # pattern (gate outcomes above the selection bits) -> row
    refcount: int = 0

    def active(self, pattern: int, gates: int = 0) -> list[Intervention]:
        """The items of selection ``pattern`` under gate outcomes ``gates`` (bit g: gate g passed)."""
        gate_of = self.gating.gate_of if self.gating is not None else None
        return [item for i, (item, bit) in enumerate(zip(self.interventions, self.requires))
                if (bit < 0 or pattern >> bit & 1) and (gate_of is None or gate_of[i] < 0 or gates >> gate_of[i] & 1)]


@dataclass
class RequestSteering:
    config: ConfigEntry
    key: int  # its entry in the manager's DecodeSpans
    rows: set[int] = field(default_factory=set)
    fixed_row: int | None = None  # the row of every token (a config without selections)
    decode_row: int | None = None  # the row of every generated token, when selections allow
    decode_span: tuple[int, float, int] | None = None  # (lo, hi, row): the row of generated positions in [lo, hi)


class SteeringManager:
    def __init__(self, hidden_size: int, num_layers: int, max_num_seqs: int = 256, saes: SaeRegistry | None = None,
                 router_experts: Mapping[int, int] | None = None):
        """``saes``: the registry ``Feature``/``FeatureClamp`` names are resolved against;
        ``router_experts``: each MoE layer's number of experts (``RouterBias``)."""
        self.parser = SpecParser(hidden_size, num_layers, saes, router_experts)
        self.num_layers = num_layers
        self.global_items: list[Intervention] = []
        self.modules: dict[str, list[Intervention]] = {}
        self._scaled_modules: dict[tuple[str, float], list[Intervention]] = {}
        self.configs: dict[bytes, ConfigEntry] = {}
        # Room for a tiered config per running request before the first growth: growing moves the
        # tables, which retires every CUDA graph that reads them.
        self.tables = RowTables(2 * max_num_seqs + 1, hidden_size)
        self.edits = EditRows(hidden_size)  # the low-rank, dense, gate and router tables' ledger
        self.row_refs: dict[int, int] = {}
        self.row_owner: dict[int, tuple[bytes, int]] = {}
        self._free_rows: list[int] = []
        self._next_row = 1
        self._token_readers = 0  # live configs that select generated rows by token id
        self.spans = DecodeSpans(max_num_seqs + 1)

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

    def module_spec(self, name: str) -> SteeringSpec:
        """A registered module as a ``SteeringSpec`` of its canonical interventions (scales folded
        in), so a client can see what the module adds, e.g. to project activations on it."""
        if name not in self.modules:
            raise InvalidRequestError(f"name: unknown module {name!r}; registered: {sorted(self.modules)}")
        return SteeringSpec(interventions=as_user_items(self.modules[name]))

    def sae_users(self, name: str) -> list[str]:
        """Who steers with the SAE registered as ``name``: global steering, modules, live requests."""
        def uses(items: Sequence[Intervention]) -> bool:
            return any(item.sae == name or (item.gate is not None and item.gate.feature is not None
                                            and item.gate.feature[0] == name) for item in items)

        users = ["global steering"] if uses(self.global_items) else []
        users += [f"steering module {module!r}" for module, items in self.modules.items() if uses(items)]
        live = sum(config.refcount for config in self.configs.values() if uses(config.interventions))
        return users + ([f"{live} live request(s)"] if live else [])

    def steerable_layers(self) -> dict[str, list[int]]:
        return {point: list(range(self.num_layers)) for point in HOOK_POINTS}

    def status(self) -> dict[str, Any]:
        def summary(items: list[Intervention]) -> dict[str, Any]:
            return {"interventions": len(items), "adds": sum(i.kind == "add" for i in items),
                    "clamps": sum(i.kind in ("clamp", "tclamp") for i in items),
                    "edits": sum(i.kind in ("lowrank", "dense") for i in items),
                    "router_biases": sum(i.kind == "router" for i in items),
                    "gated": sum(i.gate is not None for i in items),
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

    def parse_request(self, params: Any) -> list[Intervention]:
        """A request's own interventions (its module reference, scaled, and its inline spec),
        validated: the part of admission that can refuse it, run before any of a call's prompts
        runs (``admit`` then composes them with the global spec)."""
        items = []
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
        return items + self.parser.parse(params.steering_vectors, "steering_vectors")

    def admit(self, request: Request, own: list[Intervention] | None = None) -> None:
        """Compose and validate the request's steering; sets ``request.steering`` and its cache keys.
        ``own``: its interventions as ``parse_request`` gave them (None: parsed now). Raises
        ValueError before changing any state."""
        own = self.parse_request(request.params) if own is None else own
        items = [*self.global_items, *own]
        items = [item for item in items if not item.is_noop()]
        if not items:
            return
        identity = config_identity(items)
        config = self.configs.get(identity)
        if config is None:
            config = self.configs[identity] = self._new_config(identity, items)
            self._token_readers += config.reads_generated_tokens
        config.refcount += 1
        request.steering = RequestSteering(config, self.spans.new())
        request.hash_keys.extend(self._cache_keys(items, request.prompt_token_ids))

    @staticmethod
    def _new_config(identity: bytes, items: list[Intervention]) -> ConfigEntry:
        selects: list[SelectSpec] = []
        index_of: dict[int, int] = {}  # by identity: a parse makes equal selections one object
        requires = []
        for item in items:
            select = item.select
            if select is None:
                requires.append(-1)
                continue
            index = index_of.get(id(select))
            if index is None:
                if select not in selects:  # equal to one from another source (the global spec, a module)
                    selects.append(select)
                index = index_of[id(select)] = selects.index(select)
            requires.append(index)
        gating = config_gates(items, selects)
        uniform = all(set(s.to_wire()) <= _GENERATION_UNIFORM_FIELDS for s in selects)
        return ConfigEntry(identity, items, selects, requires, uniform,
                           any(s.reads_generated_tokens for s in selects), gating)

    @staticmethod
    def _cache_keys(items: list[Intervention], prompt: list[int]) -> list[tuple[int, bytes]]:
        """Prompt blocks carry the identity of the steering that touches prompt rows (from the first
        steered prompt position); blocks with generated tokens also carry the decode steering."""
        keys = []
        prompt_items, first = [], len(prompt)
        firsts: dict[int, int | None] = {}  # per selection (by id: items share it), its first prompt row
        for item in items:
            select = item.select
            if item.gate is not None and item.gate.scope == "prompt":
                continue  # it acts on generated rows only
            if select is None:
                prompt_items.append(item)
                first = 0
                continue
            if id(select) not in firsts:
                selected = select.prompt_positions_selected(prompt)
                firsts[id(select)] = selected[0] if selected else None
            if firsts[id(select)] is not None:
                prompt_items.append(item)
                first = min(first, firsts[id(select)])
        if prompt_items:
            keys.append((first, b"steer-prefill:" + config_identity(prompt_items)))
        decode_items = [i for i in items if i.select is None or i.select.may_select_generation()]
        if decode_items:
            keys.append((len(prompt), b"steer-decode:" + config_identity(decode_items)))
        return keys

    def share(self, request: Request, template: Request) -> None:
        """Give ``request`` the steering ``template`` was admitted with (an ``n``-request's later
        completions keep the group's snapshot, whatever the global spec became since)."""
        if template.steering is not None:
            template.steering.config.refcount += 1
            request.steering = RequestSteering(template.steering.config, self.spans.new())

    @staticmethod
    def cache_limit(request: Request) -> int:
        """How many leading tokens a prefix-cache hit may cover: none for a request with a gate
        that decides over the whole prompt (it must read every prompt row), else all."""
        state = request.steering
        if state is not None and state.config.gating is not None and state.config.gating.roles is not None:
            return 0
        return request.num_tokens

    def prompt_extended(self, request: Request) -> None:
        """A streaming-input chunk grew the prompt: what decode rows resolved to was decided from
        the old prompt's length (generation windows and positions count from the prompt's end)."""
        state = request.steering
        if state is not None:
            state.decode_row = state.decode_span = None
            self.spans.reset(state.key)

    def release(self, request: Request) -> None:
        """Drop the request's references; rows and configs nobody uses any more are freed."""
        state = request.steering
        if state is None:
            return
        request.steering = None
        self.spans.free(state.key)
        for row in state.rows:
            self.row_refs[row] -= 1
            if self.row_refs[row] == 0:
                del self.row_refs[row]
                identity, pattern = self.row_owner.pop(row)
                self.configs[identity].rows.pop(pattern, None)
                self.tables.clear(row)
                self.edits.clear(row)
                self._free_rows.append(row)
        config = state.config
        config.refcount -= 1
        if config.refcount == 0:
            del self.configs[config.identity]
            self._token_readers -= config.reads_generated_tokens

    # ------------------------------------------------------------ per step

    def reads_generated_tokens(self) -> bool:
        """A live config selects generated rows by token id: planning needs sampled tokens on the host."""
        return self._token_readers > 0

    def plan(self, scheduled: Sequence[ScheduledRequest], positions: np.ndarray, token_ids: np.ndarray,
             query_start: np.ndarray) -> SteeringPlan | None:
        """Each token's row for one step (rows allocated on first use); None when nothing is steered."""
        if not self.spans.live:
            return None
        if len(positions) == len(scheduled):  # decode only, one row per request: the common case, kept lean
            keys = np.fromiter((0 if (state := s.request.steering) is None else state.key for s in scheduled),
                               dtype=np.int64, count=len(scheduled))
            if not keys.any():
                return None
            index = self._decode_index(scheduled, keys, positions, token_ids)
        else:
            if not any(s.request.steering is not None for s in scheduled):
                return None
            index = np.zeros(len(positions), dtype=np.int64)
            for i, s in enumerate(scheduled):
                state = s.request.steering
                if state is not None:
                    lo, hi = query_start[i], query_start[i + 1]
                    index[lo:hi] = self._rows_for(s.request, state, positions[lo:hi], token_ids[lo:hi])
        if not index.any():
            return None
        return SteeringPlan(index, *self.tables.plan_sites(), self.tables.version + self.edits.version,
                            self.tables.plan_tclamp_sites(), self.edits.plan_sites())

    def _decode_index(self, scheduled: Sequence[ScheduledRequest], keys: np.ndarray, positions: np.ndarray,
                      token_ids: np.ndarray) -> np.ndarray:
        """The row of each request's one token (``keys``: their ``DecodeSpans`` keys): what the
        request's last such row resolved to, resolved again only where the position left its span."""
        lo, hi, rows = self.spans.gather(keys)
        for i in np.flatnonzero((positions < lo) | (positions >= hi)).tolist():
            request = scheduled[i].request
            state = request.steering
            row = int(np.ravel(self._rows_for(request, state, positions[i:i + 1], token_ids[i:i + 1]))[0])
            self.spans.set(state.key, *self._decode_span(request, state, int(positions[i])), row)
            rows[i] = row
        return rows.astype(np.int64)

    @staticmethod
    def _decode_span(request: Request, state: RequestSteering, position: int) -> tuple[float, float]:
        """The positions [lo, hi) over which the row just resolved for a step's one row of the request
        at ``position`` holds (``_rows_for`` has set the state's spans); none for a prompt row (the
        end of a prefill in chunks) or a selection by generated token ids: resolved every time."""
        config = state.config
        if state.fixed_row is not None:
            return 0, math.inf
        prompt_len = request.num_prompt_tokens
        if position < prompt_len or config.reads_generated_tokens:
            return 0, 0
        if config.generation_uniform:
            return prompt_len, math.inf
        return state.decode_span[:2]

    def take_update(self) -> SteeringUpdate | None:
        """Table changes since the last step, for the worker to apply before the next forward."""
        update = self.tables.take_update()
        edits = self.edits.take_update()
        if edits:
            update = update if update is not None else SteeringUpdate(self.tables.capacity)
            update.edits = edits
        return update

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
        single_decode = decode_chunk and len(positions) == 1 and not config.reads_generated_tokens
        if single_decode:
            span = state.decode_span
            position = int(positions[0])
            if span is not None and span[0] <= position < span[1]:
                return span[2]
        pos = torch.from_numpy(positions)
        tok = torch.from_numpy(token_ids)
        patterns = np.zeros(len(positions), dtype=np.int64)
        for bit, select in enumerate(config.selects):
            patterns |= select.mask(pos, prompt_len, tok).numpy().astype(np.int64) << bit
        unique, inverse = np.unique(patterns, return_inverse=True)
        rows = np.array([self._acquire(state, int(p)) for p in unique], dtype=np.int64)
        if decode_chunk and config.generation_uniform and len(unique) == 1:
            state.decode_row = int(rows[0])
        if single_decode:
            spans = [select.generation_span(position, prompt_len) for select in config.selects]
            state.decode_span = (max(lo for lo, _ in spans), min(hi for _, hi in spans), int(rows[0]))
        return rows[inverse]

    def _acquire(self, state: RequestSteering, pattern: int) -> int:
        """The row for (config, pattern), allocated on first use; 0 when nothing applies. With
        gates, every row the gates can move its tokens to is allocated and held with it."""
        config = state.config
        if config.gating is not None:
            return self._acquire_gated(state, pattern)
        row = config.rows.get(pattern)
        if row is None:
            active = config.active(pattern)
            if not active:
                return 0
            row = self._new_row_for(config, pattern)
            self._write(row, active)
        self._hold(state, row)
        return row

    def _acquire_gated(self, state: RequestSteering, pattern: int) -> int:
        config = state.config
        shift = len(config.selects)
        keys = [pattern | bits << shift for bits in range(1 << len(config.gating.gates))]
        if pattern not in config.rows:
            rows = {key: self._new_row_for(config, key) for key in keys}
            for bits, key in enumerate(keys):
                slots = gate_slots(config.gating, pattern, bits, lambda moved: rows[pattern | moved << shift])
                self._write(rows[key], config.active(pattern, bits), slots)
        for key in keys:
            self._hold(state, config.rows[key])
        return config.rows[pattern]

    def _new_row_for(self, config: ConfigEntry, key: int) -> int:
        row = self._free_rows.pop() if self._free_rows else self._new_row()
        config.rows[key] = row
        self.row_owner[row] = (config.identity, key)
        self.row_refs[row] = 0
        return row

    def _write(self, row: int, items: list[Intervention], gates: Sequence = ()) -> None:
        """Adds and clamps go to the row tables, edits and gate slots to the edit tables."""
        self.tables.write(row, [item for item in items if item.kind not in EDIT_KINDS])
        self.edits.write(row, [item for item in items if item.kind in EDIT_KINDS], gates)

    def _hold(self, state: RequestSteering, row: int) -> None:
        if row not in state.rows:
            state.rows.add(row)
            self.row_refs[row] += 1

    def _new_row(self) -> int:
        row = self._next_row
        self._next_row += 1
        if row >= self.tables.capacity:
            self.tables.grow(row + 1)
        return row
