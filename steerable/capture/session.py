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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerable.capture.features import SAE_FEATURES, FeatureCapture
from steerable.capture.planner import (Delivery, Destination, RequestCapture, RowSelector, as_tensor, host_array,
                                       plan_step)
from steerable.capture.serialization import CaptureMeta
from steerable.capture.sink_thread import SinkThread
from steerable.capture.store import (
    StreamConfig,
    StreamRows,
    StreamStore,
    check_reduction,
    reduce_rows,
    resolve_storage_dtype,
)
from steerable.errors import InvalidRequestError
from steerable.capture.patterns import AttentionPatterns, assemble
from steerable.checks import is_int
from steerable.hook_points import (
    ATTENTION_PATTERNS,
    COMPONENTS,
    HIDDEN_STATES,
    POST_MLP,
    ROUTER_LOGITS,
    HookLayout,
    check_residual_point,
)
from steerable.request import Request, ScheduledRequest
from steerable.selection import SelectSpec
from steerable.step import PLACEHOLDER, CapturePlan


@dataclass(frozen=True)
class CaptureSpec:
    """Per-request capture: rows of ``stream`` at ``layers`` (None = all) picked by ``select``
    (None = every row), stored as ``dtype`` (None = the model's; float32 for attention patterns),
    hidden states read at ``hook``. When the request finishes, ``reduce="last"`` keeps its last
    selected row and ``"mean"`` their float32 mean (as a stream's reductions), and ``budget_rows``
    keeps at most that many rows. ``heads``: the query heads attention patterns keep (None: all).
    ``stream="sae_features"`` reads each registered SAE of ``saes`` at its own point and keeps each
    row's ``top_k`` highest features (``layers``, ``dtype`` and ``hook`` do not apply)."""

    stream: str = HIDDEN_STATES
    layers: Sequence[int] | None = None
    select: Any = None
    dtype: str | None = None
    hook: str = POST_MLP
    reduce: str = "all"
    budget_rows: int | None = None
    heads: Sequence[int] | None = None
    saes: Sequence[str] | None = None
    top_k: int = 32


class CaptureSession:
    def __init__(self, layout: HookLayout, dtype: torch.dtype, pin_memory: bool = False,
                 host_block_lifetime: int | None = None):
        """``layout``: the components the model offers and where; ``dtype``: the model's, for rows
        stored without a dtype of their own; ``pin_memory``: streams keep rows in pinned host memory
        (a CUDA machine: resident pages, no first-touch faults while a step's rows are stored);
        ``host_block_lifetime``: how many later copying launches a step's host rows survive (the
        worker's ``host_block_lifetime``; None: threaded sinks are fed on the engine's thread)."""
        self.pin_memory = pin_memory
        self.host_block_lifetime = host_block_lifetime
        self.sink_thread: SinkThread | None = None  # while a threaded sink is running
        self._copying_steps = 0  # steps planned with rows to record
        self.available = {name: list(c.layers) for name, c in layout.components.items()}
        self.widths = {name: c.width for name, c in layout.components.items()}
        self.layouts = {name: c.describe() for name, c in layout.components.items()}
        patterns = self.layouts.get(ATTENTION_PATTERNS, {})
        self.windows = {layer: info["sliding_window"] for layer, info in patterns.items()}
        self.num_heads = next(iter(patterns.values()))["num_heads"] if patterns else 0
        self.dtype = dtype
        self.features = FeatureCapture(dtype, pin_memory)
        self.streams: dict[str, Destination] = {}
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
            raise InvalidRequestError(f"{field_name}: unknown capture stream {stream!r}; expected one of "
                                      f"{[*COMPONENTS, SAE_FEATURES]}")
        if not self.available.get(stream):  # a dense model has no router, every model has heads
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
        return component if component != HIDDEN_STATES else check_residual_point(hook, field_name)

    def _heads(self, component: str, heads: Any, field_name: str) -> tuple[int, ...] | None:
        """The query heads an attention-pattern capture keeps, sorted (None: all of them)."""
        if heads is None:
            return None
        if component != ATTENTION_PATTERNS:
            raise InvalidRequestError(f"{field_name}: only {ATTENTION_PATTERNS!r} selects heads")
        if isinstance(heads, int) and not isinstance(heads, bool):
            heads = [heads]
        if (not isinstance(heads, (list, tuple)) or not heads
                or not all(is_int(h) and 0 <= h < self.num_heads for h in heads)):
            raise InvalidRequestError(f"{field_name}: expected query-head indices in [0, {self.num_heads}), "
                                      f"got {heads!r}")
        return tuple(sorted(set(int(h) for h in heads)))

    # ------------------------------------------------------------ streams (control plane)

    def start(self, stream: str, layers: Sequence[int] | None = None, dtype: str | None = None, reduce: str = "all",
              select: Any = None, budget_rows: int | None = None, hook: str = POST_MLP, sink: Any = None,
              saes: Sequence[str] | None = None, top_k: int = 32) -> None:
        """Enable a stream with a fresh store (replacing any earlier one of the same name).

        ``sink`` (in-process callers): an object whose ``append(StreamRows)`` takes each step's rows
        instead of a store, while they are delivered (the block is valid only then), so a caller
        that knows where every row belongs copies it there once (corpus capture). Such a stream
        keeps nothing to fetch; a stopped store of the same name stays fetchable meanwhile. A sink
        with ``threaded = True`` is fed on a background thread, in step order, where the worker's
        host rows outlive later launches; ``stop`` returns once it has taken every row.
        ``sae_features`` records ``saes`` (names of registered SAEs), ``top_k`` features a row."""
        if stream == SAE_FEATURES:
            if reduce != "all":
                raise InvalidRequestError(f"reduce: sae_features keeps every selected row (reduce='all'), got {reduce!r}")
            if sink is not None and budget_rows is not None:
                raise InvalidRequestError("sink: takes every selected row as it arrives (no budget_rows)")
            self.features.start(saes, top_k, select, budget_rows, sink, self._serial + 1)
            self._serial += 1
            self._start_sink_thread(sink)
            return
        component = self._component(stream)
        if component == ATTENTION_PATTERNS:  # ragged rows: a request's own CaptureSpec carries them
            raise InvalidRequestError(f"stream: {ATTENTION_PATTERNS!r} is captured per request "
                                      "(SamplingParams(capture=CaptureSpec(...))), not as a stream")
        hook = self._hook(component, hook, "hook")
        layer_list = self._layers(component, layers, "layers")
        config = StreamConfig(layer_list, dtype, reduce, select, budget_rows)  # errors name their field
        if sink is not None and (reduce != "all" or budget_rows is not None):
            raise InvalidRequestError("sink: takes every selected row as it arrives (reduce='all', no budget_rows)")
        store = sink if sink is not None else StreamStore(config, layer_list, self.layouts.get(component, {}),
                                                          self.pin_memory)
        # reduce="last" keeps each request's final input row: the last prompt row or a generated one,
        # neither of which a prefix-cache hit can skip, so it must not disable the cache.
        row_select = SelectSpec(prompt_positions=[-1], generation="all") if reduce == "last" else config.select
        self._serial += 1
        self.streams[stream] = Destination(("stream", stream, self._serial), component, hook, layer_list,
                                            config.dtype, row_select, store)
        if sink is None:
            self.stopped.pop(stream, None)
        self._start_sink_thread(sink)

    def _start_sink_thread(self, sink: Any) -> None:
        if getattr(sink, "threaded", False) and self.host_block_lifetime is not None and self.sink_thread is None:
            self.sink_thread = SinkThread()

    def _all_streams(self) -> list[Destination]:
        return [*self.streams.values(), *self.features.streams.values()]

    def stop(self, stream: str) -> None:
        """Stop recording; stored rows (and reductions of running requests) stay fetchable."""
        if stream == SAE_FEATURES:
            self.features.stop()
        else:
            self._component(stream)
            destination = self.streams.pop(stream, None)
            if destination is not None and isinstance(destination.sink, StreamStore):
                store = destination.sink
                for request_id in store.pending_requests():
                    store.finish_request(request_id)
                self.stopped[stream] = store
        self._serial += 1
        if self.sink_thread is not None and not any(getattr(d.sink, "threaded", False) for d in self._all_streams()):
            self.close()  # a threaded sink is done once it has taken every row; its failure is raised here

    def close(self) -> None:
        """End the sink thread, once it has fed every row it was given."""
        thread, self.sink_thread = self.sink_thread, None
        if thread is not None:
            thread.close()

    def _store(self, stream: str) -> StreamStore | None:
        self._component(stream)
        destination = self.streams.get(stream)
        if destination is not None and isinstance(destination.sink, StreamStore):
            return destination.sink
        return self.stopped.get(stream)

    def fetch(self, stream: str, clear: bool = True, layers: Sequence[Any] | None = None,
              req_ids: Sequence[str] | None = None) -> tuple[dict[Any, Any], dict[Any, CaptureMeta]]:
        """Rows per layer (per SAE name for ``sae_features``: ``layers`` then names SAEs)."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        if stream == SAE_FEATURES:
            return self.features.fetch(clear, layers, req_ids)
        store = self._store(stream)
        if store is None:
            return {}, {}
        return store.fetch(list(layers) if layers is not None else None,
                           list(req_ids) if req_ids is not None else None, clear_selected=clear)

    def clear(self, stream: str) -> None:
        if stream == SAE_FEATURES:
            self.features.clear()
            return
        store = self._store(stream)
        if store is not None:
            store.clear()

    def status(self, stream: str) -> dict[str, Any]:
        if stream == SAE_FEATURES:
            return {**self.features.status(), "graph_replays": self.graph_replays,
                    "eager_capture_forwards": self.eager_capture_forwards}
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
            if spec.stream == SAE_FEATURES and not any(d.component == SAE_FEATURES for d in destinations):
                destinations += self._feature_destinations(request, spec)
                continue
            component = self._component(spec.stream, "capture.stream") if spec.stream != SAE_FEATURES else SAE_FEATURES
            if any(d.component == component for d in destinations):
                raise InvalidRequestError(f"capture.stream: {component!r} requested twice")
            hook = self._hook(component, spec.hook, "capture.hook")
            layers = self._layers(component, spec.layers, "capture.layers")
            dtype = resolve_storage_dtype(spec.dtype, "capture.dtype")
            check_reduction(spec.reduce, spec.budget_rows, "capture.")
            heads = self._heads(component, spec.heads, "capture.heads")
            if component == ATTENTION_PATTERNS:
                if spec.reduce != "all":
                    raise InvalidRequestError(f"capture.reduce: {ATTENTION_PATTERNS!r} keeps its rows (reduce='all')")
                dtype = dtype or torch.float32
            try:
                select = SelectSpec.parse(spec.select) if spec.select is not None else None
            except ValueError as err:
                raise InvalidRequestError(f"capture.{err}") from None  # "capture.select...: ..."
            destinations.append(Destination(("request", request.request_id, component), component, hook,
                                            layers, dtype, select, None, spec.reduce, spec.budget_rows, heads))
        state = RequestCapture(destinations)
        state.reads_generated_tokens = any(d.select is not None and d.select.reads_generated_tokens
                                           for d in destinations)
        self._token_readers += state.reads_generated_tokens
        self.requests_in_use += bool(destinations)
        self.features.users.update(d.name for d in destinations if d.name is not None)
        for d in destinations:
            d.sink = state
        request.capture = state
        self._build_selectors(request)

    def _feature_destinations(self, request: Request, spec: CaptureSpec) -> list[Destination]:
        try:
            select = SelectSpec.parse(spec.select) if spec.select is not None else None
        except ValueError as err:
            raise InvalidRequestError(f"capture.{err}") from None
        check_reduction(spec.reduce, spec.budget_rows, "capture.")
        return self.features.destinations(spec.saes, spec.top_k, select, ("request", request.request_id, SAE_FEATURES),
                                          spec.reduce, spec.budget_rows, "capture.")

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

    def _destinations(self, request: Request) -> list[Destination]:
        own = request.capture.destinations if request.capture is not None else []
        return [*self.streams.values(), *self.features.streams.values(), *own]

    def _selector(self, request: Request, destination: Destination) -> RowSelector:
        if request.capture is None:
            request.capture = RequestCapture([])
        selectors = request.capture.selectors
        selector = selectors.get(destination.key)
        if selector is None:
            selector = selectors[destination.key] = RowSelector.build(destination.select, request.prompt_token_ids)
        return selector

    # ------------------------------------------------------------ per step

    def plan(self, scheduled: Sequence[ScheduledRequest], positions: np.ndarray, token_ids: np.ndarray,
             query_start: np.ndarray) -> tuple[CapturePlan, Delivery] | None:
        """Which rows each destination records this step (None when none): the plain plan for the
        worker, and what delivery needs when the rows come back."""
        if not self.streams and not self.features.streams and not any(s.request.capture is not None and s.request.capture.destinations
                                        for s in scheduled):
            return None
        planned = plan_step(scheduled, positions, token_ids, query_start, self._destinations, self._selector,
                            self._serial)
        if planned is not None:
            planned[1].copying_step = self._copying_steps
            if self.sink_thread is not None:  # this launch's copy reuses the host rows of an older step
                self.sink_thread.wait_before(self._copying_steps - self.host_block_lifetime)
            self._copying_steps += 1
        return planned

    def reads_generated_tokens(self) -> bool:
        """A destination selects generated rows by token id: planning needs sampled tokens on the host."""
        return self._token_readers > 0 or any(
            d.select is not None and d.select.reads_generated_tokens for d in self._all_streams())

    def deliver(self, delivery: Delivery, captured: list[torch.Tensor], graphed: bool) -> None:
        """Hand each destination its rows of a finished step: a stream takes every request's rows of a
        group at once, a request's own capture its rows of every layer in one copy. Requests that
        finished meanwhile get nothing: their last row fed back the token that stopped them, or they
        were aborted. ``captured[g]`` is group g's ``[layers, rows, width]`` on the host, valid only
        during this call."""
        if graphed:
            self.graph_replays += 1
        else:
            self.eager_capture_forwards += 1
        for group, block in zip(delivery.groups, captured):
            _fill_pending_tokens(group)
            streams: dict[int, tuple[Destination, list[tuple[Request, np.ndarray]]]] = {}
            rows_np = None
            for destination, request, where in group.takers:
                if request.finished or request.paused:
                    continue
                self.rows_delivered += len(where) * block.shape[0]  # rows of every layer of the group
                if not isinstance(destination.sink, RequestCapture):  # a stream's store or sink
                    streams.setdefault(id(destination), (destination, []))[1].append((request, where))
                else:
                    if rows_np is None:
                        rows_np = host_array(block)
                    if group.consecutive:  # slices: views of this step's labels, one copy of the rows
                        a = int(where[0])
                        where = slice(a, a + len(where))
                    destination.sink.add(destination.key, rows_np[:, where].copy(), block.dtype,
                                         group.positions[where], group.token_ids[where])
            for destination, takers in streams.values():
                where = np.concatenate([w for _, w in takers]) if len(takers) > 1 else takers[0][1]
                counts = np.fromiter((len(w) for _, w in takers), np.int64, len(takers))
                rows = StreamRows(block, where, [r.request_id for r, _ in takers], counts, group.positions[where],
                                  group.token_ids[where])
                if self.sink_thread is not None and getattr(destination.sink, "threaded", False):
                    self.sink_thread.submit(delivery.copying_step, destination.sink.append, rows)
                else:
                    destination.sink.append(rows)

    # ------------------------------------------------------------ lifecycle

    def finish(self, request: Request, aborted: bool = False) -> tuple[dict, dict]:
        """Close the request: reductions of streams materialise; its own captures are returned
        ({stream: {layer: Tensor}}, {stream: {layer: CaptureMeta}}) and passed to consumers."""
        for destination in self._all_streams():
            store = destination.sink
            if isinstance(store, StreamStore) and aborted:
                store.abort_request(request.request_id)
            elif isinstance(store, StreamStore):
                store.finish_request(request.request_id)
        state = request.capture
        request.capture = None
        if state is not None:
            self._token_readers -= state.reads_generated_tokens
            self.requests_in_use -= bool(state.destinations)
            self.features.users.subtract(d.name for d in state.destinations if d.name is not None)
        if state is None or aborted or not state.destinations:
            return {}, {}
        tensors: dict[str, dict[int, torch.Tensor]] = {}
        metas: dict[str, dict[int, CaptureMeta]] = {}
        for destination in state.destinations:
            component = destination.component
            parts = state.rows.get(destination.key, [])
            dtype = state.dtypes.get(destination.key)
            if destination.name is not None:  # sae_features, keyed by SAE name
                features, meta = self.features.assemble(destination, parts, request.request_id)
                tensors.setdefault(component, {})[destination.name] = features
                metas.setdefault(component, {})[destination.name] = meta
                continue
            tensors[component], metas[component] = {}, {}
            positions = np.concatenate([p[1] for p in parts]) if parts else np.empty(0, np.int32)
            token_ids = np.concatenate([p[2] for p in parts]) if parts else np.empty(0, np.int32)
            if component == ATTENTION_PATTERNS:
                tensors[component], metas[component] = self._patterns(request, destination, parts, dtype, positions,
                                                                      token_ids)
                continue
            for i, layer in enumerate(destination.layers):
                if parts:
                    tensor = as_tensor(np.concatenate([p[0][i] for p in parts]), dtype)
                else:
                    tensor = torch.empty(0, self.widths[component], dtype=destination.dtype or self.dtype)
                tensor, kept_positions, kept_tokens = reduce_rows(tensor, positions, token_ids, destination.reduce,
                                                                  destination.budget_rows, destination.dtype)
                tensors[component][layer] = tensor
                metas[component][layer] = CaptureMeta([request.request_id] * len(kept_positions),
                                                      torch.from_numpy(kept_positions), torch.from_numpy(kept_tokens))
        for consumer in self.consumers:
            for component in tensors:
                if component != ATTENTION_PATTERNS:  # consumers write [rows, width] tensors
                    consumer.on_capture(request.request_id, component, tensors[component], metas[component])
        return tensors, metas

    def _patterns(self, request: Request, destination: Destination, parts: list, dtype: torch.dtype | None,
                  positions: np.ndarray, token_ids: np.ndarray
                  ) -> tuple[dict[int, AttentionPatterns], dict[int, CaptureMeta]]:
        """A request's attention patterns per layer, cut from the padded step blocks into rows (at
        most ``budget_rows`` of them), with their labels."""
        keep = len(positions) if destination.budget_rows is None else min(len(positions), destination.budget_rows)
        heads = list(destination.heads) if destination.heads is not None else list(range(self.num_heads))
        blocks_per_layer: list[list[torch.Tensor]] = [[] for _ in destination.layers]
        left = keep
        for block, _, _ in parts:
            take = min(left, block.shape[1])
            for i in range(len(destination.layers)):
                blocks_per_layer[i].append(as_tensor(block[i, :take], dtype))
            left -= take
        meta = CaptureMeta([request.request_id] * keep, torch.from_numpy(positions[:keep].copy()),
                           torch.from_numpy(token_ids[:keep].copy()))
        patterns = {layer: assemble(blocks_per_layer[i], positions[:keep], self.windows[layer], heads)
                    for i, layer in enumerate(destination.layers)}
        return patterns, {layer: meta for layer in destination.layers}


def _fill_pending_tokens(group: Any) -> None:
    """Rows planned while their input token was still being sampled carry PLACEHOLDER labels; by
    delivery that token is known."""
    token_ids, positions = group.token_ids, group.positions
    pending = token_ids == PLACEHOLDER
    if not pending.any():
        return
    pending, position_of = pending.tolist(), positions.tolist()
    for _, request, where in group.takers:
        if request.finished or request.paused:
            continue
        if len(where) == 1:  # a decode row: scalar work
            i = int(where[0])
            if pending[i]:
                token_ids[i] = request.all_token_ids[position_of[i]]
            continue
        for i in where.tolist():
            if pending[i]:
                token_ids[i] = request.all_token_ids[position_of[i]]
