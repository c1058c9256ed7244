"""The capture plane: which rows each step must record, the hook-point reader that stages them on
the device, one coalesced device-to-host copy per step, and delivery to streams and requests.

Two kinds of destination read the same hook points:
- streams (``start_capture``): engine-wide, every request while enabled, fetched later;
- per-request specs (``SamplingParams(capture=CaptureSpec(...))``): delivered on the request's
  ``RequestOutput`` when it finishes.
A row is a token *input* at an absolute position. Each is delivered once: rows below a request's
high-water mark were delivered before a preemption and are not recorded again, and prompt rows a
destination needs are never skipped by a prefix-cache hit (the scheduler asks ``cache_limit``).
"""

from __future__ import annotations

from steerable.errors import InvalidRequestError
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.capture.serialization import CaptureMeta, deserialize_captured
from steerable.capture.store import (StreamConfig, StreamStore, check_reduction, reduce_rows,
                                     resolve_storage_dtype)
from steerable.engine.request import PLACEHOLDER, Request
from steerable.hook_points import ATTENTION_HEADS, POST_MLP, RESIDUAL_POINTS, ROUTER_LOGITS
from steerable.selection import SelectSpec

HIDDEN_STATES = "hidden_states"
COMPONENTS = (HIDDEN_STATES, ATTENTION_HEADS, ROUTER_LOGITS)


@dataclass(frozen=True)
class CaptureSpec:
    """Per-request capture: rows of ``stream`` at ``layers`` (None = all) picked by ``select``
    (None = every row), stored as ``dtype`` (None = the model's), hidden states read at ``hook``.
    When the request finishes, ``reduce="last"`` keeps its last selected row and ``"mean"`` their
    float32 mean (as a stream's reductions), and ``budget_rows`` keeps at most that many rows."""

    stream: str = HIDDEN_STATES
    layers: Sequence[int] | None = None
    select: Any = None
    dtype: str | None = None
    hook: str = POST_MLP
    reduce: str = "all"
    budget_rows: int | None = None


@dataclass
class RowSelector:
    """A destination's row choice for one request, resolved once at admission (prompt part) so the
    per-step work is a range lookup; generation rows fall back to ``SelectSpec.mask``."""

    select: SelectSpec | None
    prompt_positions: np.ndarray | None  # sorted selected prompt positions; None = every row
    generation: bool  # may select generation rows

    @classmethod
    def build(cls, select: SelectSpec | None, prompt: list[int]) -> "RowSelector":
        if select is None:
            return cls(None, None, True)
        return cls(select, np.asarray(select.prompt_positions_selected(prompt), dtype=np.int64),
                   select.may_select_generation())

    def first_prompt_position(self, at_least: int, prompt_len: int) -> int:
        """Lowest selected prompt position >= at_least (prompt_len if none): cache hits stop there."""
        if self.prompt_positions is None:
            return min(at_least, prompt_len)
        later = self.prompt_positions[self.prompt_positions >= at_least]
        return int(later[0]) if len(later) else prompt_len

    def next_position(self, at_least: int, prompt_len: int) -> float:
        """Lowest position >= at_least this selector might pick (inf when none can follow)."""
        if self.select is None:
            return at_least
        return self.select.next_candidate(at_least, prompt_len)

    def rows(self, positions: np.ndarray, token_ids: np.ndarray, prompt_len: int, skip_below: int) -> np.ndarray:
        """Indices into this chunk of the rows to record (positions are consecutive)."""
        start, n = int(positions[0]), len(positions)
        lo = max(start, skip_below)
        if self.prompt_positions is None:
            return np.arange(lo - start, n) if lo < start + n else np.empty(0, np.int64)
        pp = self.prompt_positions
        prompt_rows = pp[(pp >= lo) & (pp < min(start + n, prompt_len))] - start
        if not self.generation or start + n <= prompt_len:
            return prompt_rows
        g0 = max(lo, prompt_len) - start
        if g0 >= n:
            return prompt_rows
        mask = self.select.mask(torch.from_numpy(positions[g0:]), prompt_len, torch.from_numpy(token_ids[g0:]))
        return np.concatenate([prompt_rows, np.flatnonzero(mask.numpy()) + g0])


@dataclass
class _Destination:
    """A stream or one request's spec: what to read and where it goes."""

    key: tuple  # ("stream", name, serial) or ("request", request_id, stream)
    component: str
    hook: str  # hook point name read (residual point, attention_heads or router_logits)
    layers: list[int]
    dtype: torch.dtype | None
    select: SelectSpec | None
    sink: Any  # the StreamStore, or the request's RequestCapture
    reduce: str = "all"  # a request's own reduction (a stream's is in its StreamStore)
    budget_rows: int | None = None


@dataclass
class RequestCapture:
    """A request's own captures, accumulated until it finishes."""

    destinations: list["_Destination"]
    selectors: dict[tuple, RowSelector] = field(default_factory=dict)  # incl. lazily built stream selectors
    # No destination wants a row before this position (valid while ``plan_version`` matches the
    # session's): steps that stay below it skip the request with one comparison.
    next_position: float = 0
    plan_version: int = -1
    reads_generated_tokens: bool = False
    rows: dict[tuple[str, int], list[tuple[torch.Tensor, np.ndarray, np.ndarray]]] = field(default_factory=dict)


@dataclass
class _Group:
    """Destinations that read the same (hook, layers, dtype) share one gather per layer; the union
    of their rows is gathered once and split on the host."""

    hook: str
    layers: list[int]
    dtype: torch.dtype | None
    rows: np.ndarray  # step rows, sorted, unique
    positions: np.ndarray  # int32 per row
    token_ids: np.ndarray  # int32 per row
    takers: list[tuple[_Destination, Request, np.ndarray]]  # destination, request, its indices into ``rows``
    index: torch.Tensor | None = None  # device copy of ``rows`` (padded when a CUDA graph replays it)

    @property
    def signature(self) -> tuple:
        return self.hook, tuple(self.layers), self.dtype


@dataclass
class StepCapture:
    """Per-step plan: gather groups, which groups read each hook site, and the gathered tensors."""

    groups: list[_Group]
    sites: dict[tuple[str, int], list[int]]
    staged: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (group, layer) -> rows
    host: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # the same rows on the host
    copied: Any = None  # event after the device-to-host copies

    @property
    def signature(self) -> tuple:
        """Shape of the plan a CUDA graph bakes in (row contents and counts are data)."""
        return tuple(g.signature for g in self.groups)


class CaptureSession:
    def __init__(self, layers: dict[str, list[int]], widths: dict[str, int], layouts: dict[str, dict],
                 device: torch.device, dtype: torch.dtype):
        """``layers[component]``: layers where the model places that component's hook point."""
        self.available = layers
        self.widths = widths
        self.layouts = layouts
        self.device = device
        self.dtype = dtype
        self.streams: dict[str, _Destination] = {}
        self.stopped: dict[str, StreamStore] = {}
        self.consumers: list[Any] = []
        self._serial = 0  # bumps when a stream starts or stops: cached per-request plans go stale
        self._token_readers = 0  # live requests whose own selection reads generated token ids
        self.requests_in_use = 0  # live requests with their own CaptureSpec
        self.rows_delivered = 0  # rows handed to streams and requests, counted per layer
        self.graph_replays = 0
        self.eager_capture_forwards = 0

    # ------------------------------------------------------------ validation helpers

    def _component(self, stream: str, field_name: str = "stream") -> str:
        if stream not in COMPONENTS:
            raise InvalidRequestError(f"{field_name}: unknown capture stream {stream!r}; expected one of {list(COMPONENTS)}")
        if not self.available.get(stream):
            what = "a mixture-of-experts model" if stream == ROUTER_LOGITS else "attention heads"
            raise InvalidRequestError(f"{field_name}: {stream!r} needs {what}; this model has no such layers")
        return stream

    def _layers(self, component: str, layers: Sequence[int] | None, field_name: str) -> list[int]:
        available = self.available[component]
        if layers is None:
            return list(available)
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        bad = [layer for layer in layers if not isinstance(layer, int) or isinstance(layer, bool)
               or layer not in available]
        if bad or not layers:
            raise InvalidRequestError(f"{field_name}: layers {bad or layers} are not capturable for {component!r}; "
                             f"available: {available}")
        return sorted(set(layers))

    def _hook(self, component: str, hook: str, field_name: str) -> str:
        if component != HIDDEN_STATES:
            return component
        if hook not in RESIDUAL_POINTS:
            raise InvalidRequestError(f"{field_name}: unknown hook {hook!r}; expected one of {list(RESIDUAL_POINTS)}")
        return hook

    # ------------------------------------------------------------ streams (control plane)

    def start(self, stream: str, layers: Sequence[int] | None = None, dtype: str | None = None, reduce: str = "all",
              select: Any = None, budget_rows: int | None = None, hook: str = POST_MLP) -> None:
        """Enable a stream with a fresh store (replacing any earlier one of the same name)."""
        component = self._component(stream)
        hook = self._hook(component, hook, "hook")
        layer_list = self._layers(component, layers, "layers")
        config = StreamConfig(layer_list, dtype, reduce, select, budget_rows)  # errors name their field
        store = StreamStore(config, layer_list, self.layouts.get(component, {}))
        # reduce="last" keeps each request's final input row: the last prompt row or a generated one,
        # neither of which a prefix-cache hit can skip, so it must not disable the cache.
        row_select = SelectSpec(prompt_positions=[-1], generation="all") if reduce == "last" else config.select
        self._serial += 1
        self.streams[stream] = _Destination(("stream", stream, self._serial), component, hook, layer_list,
                                            config.dtype, row_select, store)
        self.stopped.pop(stream, None)

    def stop(self, stream: str) -> None:
        """Stop recording; stored rows (and reductions of running requests) stay fetchable."""
        self._component(stream)
        destination = self.streams.pop(stream, None)
        self._serial += 1
        if destination is not None:
            store = destination.sink
            for request_id in {rid for rid, _ in store.partial}:
                store.finish_request(request_id)
            self.stopped[stream] = store

    def _store(self, stream: str) -> StreamStore | None:
        self._component(stream)
        if stream in self.streams:
            return self.streams[stream].sink
        return self.stopped.get(stream)

    def fetch(self, stream: str, clear: bool = True, layers: Sequence[int] | None = None,
              req_ids: Sequence[str] | None = None) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta]]:
        store = self._store(stream)
        if store is None:
            return {}, {}
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        wire = store.serialize(list(layers) if layers is not None else None,
                               list(req_ids) if req_ids is not None else None, clear_selected=clear)
        return deserialize_captured(wire)

    def clear(self, stream: str) -> None:
        store = self._store(stream)
        if store is not None:
            store.clear()

    def status(self, stream: str) -> dict[str, Any]:
        component = self._component(stream)
        store = self._store(stream)
        base = {"enabled": stream in self.streams, "stream": stream,
                "hooked_layers": list(self.available[component]),
                "layouts": self.layouts.get(component, {}),
                "graph_replays": self.graph_replays, "eager_capture_forwards": self.eager_capture_forwards}
        if store is None:
            return base
        base.update(store.status())
        base["hook"] = self.streams[stream].hook if stream in self.streams else None
        return base

    # ------------------------------------------------------------ admission

    def admit(self, request: Request) -> None:
        """Validate ``params.capture`` and attach the request's capture state (ValueError names the field)."""
        specs = request.params.capture
        if specs is None:
            return
        if isinstance(specs, CaptureSpec):
            specs = [specs]
        if not isinstance(specs, (list, tuple)) or not all(isinstance(s, CaptureSpec) for s in specs):
            raise InvalidRequestError("capture: expected a CaptureSpec or a list of them")
        destinations = []
        for spec in specs:
            component = self._component(spec.stream, "capture.stream")
            if any(d.component == component for d in destinations):
                raise InvalidRequestError(f"capture.stream: {component!r} requested twice")
            hook = self._hook(component, spec.hook, "capture.hook")
            layers = self._layers(component, spec.layers, "capture.layers")
            dtype = resolve_storage_dtype(spec.dtype, "capture.dtype")
            check_reduction(spec.reduce, spec.budget_rows, "capture.")
            try:
                select = SelectSpec.parse(spec.select) if spec.select is not None else None
            except ValueError as err:
                raise InvalidRequestError(f"capture.{err}") from None  # "capture.select...: ..."
            destinations.append(_Destination(("request", request.request_id, component), component, hook,
                                             layers, dtype, select, None, spec.reduce, spec.budget_rows))
        state = RequestCapture(destinations)
        state.reads_generated_tokens = any(d.select is not None and d.select.reads_generated_tokens
                                           for d in destinations)
        self._token_readers += state.reads_generated_tokens
        self.requests_in_use += bool(destinations)
        for d in destinations:
            d.sink = state
        request.capture = state
        self._build_selectors(request)

    def prompt_extended(self, request: Request) -> None:
        """A streaming-input request resumed with a longer prompt: selections are resolved on it
        again. Rows below its high-water mark were delivered and stay so."""
        state = request.capture
        if state is not None:
            state.selectors.clear()  # streams' selectors are rebuilt when next needed
            state.plan_version = -1
            self._build_selectors(request)

    @staticmethod
    def _build_selectors(request: Request) -> None:
        state = request.capture
        for d in state.destinations:
            state.selectors[d.key] = RowSelector.build(d.select, request.prompt_token_ids)

    def cache_limit(self, request: Request) -> int:
        """How many leading tokens a prefix-cache hit may cover: stop at the first prompt row some
        destination still needs (rows below the high-water mark were already delivered)."""
        limit = request.num_tokens
        prompt_len = request.num_prompt_tokens
        done = request.max_computed_tokens
        for destination in self._destinations(request):
            selector = self._selector(request, destination)
            limit = min(limit, selector.first_prompt_position(done, prompt_len))
        return limit

    def _destinations(self, request: Request) -> list[_Destination]:
        own = request.capture.destinations if request.capture is not None else []
        return [*self.streams.values(), *own]

    def _selector(self, request: Request, destination: _Destination) -> RowSelector:
        if request.capture is None:
            request.capture = RequestCapture([])
        selectors = request.capture.selectors
        selector = selectors.get(destination.key)
        if selector is None:
            selector = selectors[destination.key] = RowSelector.build(destination.select, request.prompt_token_ids)
        return selector

    # ------------------------------------------------------------ per step

    def prepare(self, batch: Any) -> None:
        """Plan which rows each destination records this step; ``batch.capture`` is None when none."""
        batch.capture = None
        if not self.streams and not any(s.request.capture is not None and s.request.capture.destinations
                                        for s in batch.scheduled):
            return
        starts = batch.host_query_start
        picks: dict[tuple, list] = {}  # group signature -> [(destination, step rows, request id)]
        for i, item in enumerate(batch.scheduled):
            request = item.request
            state = request.capture
            end = request.num_computed_tokens + item.num_tokens
            if state is not None and state.plan_version == self._serial and state.next_position >= end:
                continue
            destinations = self._destinations(request)
            if not destinations:
                continue
            lo, hi = int(starts[i]), int(starts[i + 1])
            positions = batch.host_positions[lo:hi]
            prompt_len = request.num_prompt_tokens
            next_position = float("inf")
            for destination in destinations:
                selector = self._selector(request, destination)
                next_position = min(next_position, selector.next_position(end, prompt_len))
                if not selector.generation and positions[0] >= prompt_len:
                    continue
                rows = selector.rows(positions, batch.host_token_ids[lo:hi], prompt_len,
                                     request.max_computed_tokens)
                if len(rows):
                    key = (destination.hook, tuple(destination.layers), destination.dtype)
                    picks.setdefault(key, []).append((destination, rows + lo, request))
            request.capture.next_position, request.capture.plan_version = next_position, self._serial
        if not picks:
            return
        groups, sites = [], {}
        for (hook, layers, dtype), entries in picks.items():
            rows = np.unique(np.concatenate([e[1] for e in entries]))
            takers = [(destination, request, np.searchsorted(rows, step_rows))
                      for destination, step_rows, request in entries]
            group = _Group(hook, list(layers), dtype, rows, batch.host_positions[rows].astype(np.int32),
                           batch.host_token_ids[rows].astype(np.int32), takers)
            for layer in layers:
                sites.setdefault((hook, layer), []).append(len(groups))
            groups.append(group)
        batch.capture = StepCapture(groups, sites)

    def reads_generated_tokens(self) -> bool:
        """A destination selects generated rows by token id: planning needs sampled tokens on the host."""
        return self._token_readers > 0 or any(
            d.select is not None and d.select.reads_generated_tokens for d in self.streams.values())

    def wants(self, point: str, layer: int, batch: Any) -> bool:
        step = batch.capture
        return step is not None and (point, layer) in step.sites

    def record(self, point: str, layer: int, value: torch.Tensor, batch: Any) -> None:
        """HookPoints reader: gather the planned rows into a fresh tensor (safe to copy later)."""
        step = batch.capture
        if step is None:
            return
        for g in step.sites.get((point, layer), ()):
            group = step.groups[g]
            rows = value.index_select(0, group.index)
            step.staged[(g, layer)] = rows.to(group.dtype) if group.dtype is not None else rows

    def copy_out(self, batch: Any) -> None:
        """Right after the forward is enqueued: start one pinned device-to-host copy per dtype of the
        step's gathered rows. It must be enqueued before the next step, whose CUDA-graph replay
        reuses the gather buffers."""
        step = batch.capture
        if step is None or not step.staged:
            return
        if batch.graphed:
            self.graph_replays += 1
        else:
            self.eager_capture_forwards += 1
        keys = list(step.staged)
        step.host = dict(zip(keys, _to_host([step.staged[k][:len(step.groups[k[0]].rows)] for k in keys])))
        step.copied = torch.cuda.Event() if self.device.type == "cuda" else None
        if step.copied is not None:
            step.copied.record()
        step.staged.clear()

    def deliver(self, batch: Any) -> None:
        """Once the step has finished: hand each destination its rows, split per request."""
        step = batch.capture
        if step is None or not step.host:
            return
        if step.copied is not None:
            step.copied.synchronize()
        for group in step.groups:
            _fill_pending_tokens(group)
        for (g, layer), tensor in step.host.items():
            group = step.groups[g]
            for destination, request, where in group.takers:
                if request.finished or request.paused:  # its last row fed a stop token back, or it was aborted
                    continue
                # A compact copy per request: stored rows never pin the whole step buffer.
                rows = tensor.index_select(0, torch.from_numpy(where))
                self._deliver_rows(destination, layer, request.request_id, rows, group.positions[where],
                                   group.token_ids[where])
        step.host.clear()

    def _deliver_rows(self, destination: _Destination, layer: int, request_id: str, tensor: torch.Tensor,
                      positions: np.ndarray, token_ids: np.ndarray) -> None:
        self.rows_delivered += len(tensor)
        sink = destination.sink
        if isinstance(sink, StreamStore):
            sink.append(layer, request_id, tensor, positions, token_ids)
        else:
            sink.rows.setdefault((destination.component, layer), []).append((tensor, positions, token_ids))

    # ------------------------------------------------------------ lifecycle

    def finish(self, request: Request, aborted: bool = False) -> tuple[dict, dict]:
        """Close the request: reductions of streams materialise; its own captures are returned
        ({stream: {layer: Tensor}}, {stream: {layer: CaptureMeta}}) and passed to consumers."""
        for destination in self.streams.values():
            store = destination.sink
            if aborted:
                store.abort_request(request.request_id)
            else:
                store.finish_request(request.request_id)
        state = request.capture
        request.capture = None
        if state is not None:
            self._token_readers -= state.reads_generated_tokens
            self.requests_in_use -= bool(state.destinations)
        if state is None or aborted or not state.destinations:
            return {}, {}
        tensors: dict[str, dict[int, torch.Tensor]] = {}
        metas: dict[str, dict[int, CaptureMeta]] = {}
        for destination in state.destinations:
            component = destination.component
            tensors[component], metas[component] = {}, {}
            for layer in destination.layers:
                parts = state.rows.get((component, layer), [])
                width = self.widths[component]
                dtype = destination.dtype or self.dtype
                tensor = torch.cat([p[0] for p in parts]) if parts else torch.empty(0, width, dtype=dtype)
                positions = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int32)
                token_ids = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, np.int32)
                tensor, positions, token_ids = reduce_rows(tensor, positions, token_ids, destination.reduce,
                                                           destination.budget_rows, destination.dtype)
                tensors[component][layer] = tensor
                metas[component][layer] = CaptureMeta([request.request_id] * len(positions),
                                                      torch.from_numpy(positions), torch.from_numpy(token_ids))
        for consumer in self.consumers:
            for component in tensors:
                consumer.on_capture(request.request_id, component, tensors[component], metas[component])
        return tensors, metas


def _fill_pending_tokens(group: _Group) -> None:
    """Rows planned while their input token was still being sampled carry PLACEHOLDER labels; by
    delivery that token is known."""
    for _, request, where in group.takers:
        if request.finished or request.paused:
            continue
        missing = where[group.token_ids[where] == PLACEHOLDER]
        for i in missing:
            group.token_ids[i] = request.all_token_ids[group.positions[i]]


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Enqueue the copies (one pinned buffer per dtype); the caller waits before reading."""
    if not tensors or tensors[0].device.type == "cpu":
        return tensors
    result: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        pinned = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            result[i] = pinned[offset:offset + n].view(tensors[i].shape)
            offset += n
    return result
