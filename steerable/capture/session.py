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

from steerable.capture.features import SAE_FEATURES
from steerable.capture.planner import (
    Delivery,
    Destination,
    RequestCapture,
    RowSelector,
    as_tensor,
    host_array,
    plan_step,
)
from steerable.capture.prefix_rows import PrefixRows, ServedRows
from steerable.capture.request_rows import assemble_patterns, assemble_rows, parts_block
from steerable.capture.serialization import CaptureMeta
from steerable.capture.store import StreamRows, StreamStore, check_reduction, resolve_storage_dtype
from steerable.capture.streams import CaptureStreams
from steerable.errors import InvalidRequestError
from steerable.hook_points import (
    ATTENTION_PATTERNS,
    HIDDEN_STATES,
    POST_MLP,
    TRANSCODER_ERROR,
    HookLayout,
)
from steerable.request import Request, ScheduledRequest
from steerable.selection import SelectSpec
from steerable.step import CapturePlan


@dataclass(frozen=True)
class CaptureSpec:
    """Per-request capture: rows of ``stream`` at ``layers`` (None = all) picked by ``select``
    (None = every row), stored as ``dtype`` (None = the model's; float32 for attention patterns),
    hidden states read at ``hook``. When the request finishes, ``reduce="last"`` keeps its last
    selected row and ``"mean"`` their float32 mean (as a stream's reductions), and ``budget_rows``
    keeps at most that many rows. ``heads``: the query heads attention patterns keep (None: all).
    ``stream="sae_features"`` reads each registered SAE (or transcoder) of ``saes`` at its own point
    and keeps each row's ``top_k`` highest features (``layers``, ``dtype`` and ``hook`` do not apply);
    ``stream="transcoder_error"`` keeps each transcoder's error node, the MLP's output minus its
    reconstruction, float32, at each of its layers. ``hook`` may also be ``mlp_in`` or ``mlp_out``."""

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


class CaptureSession(CaptureStreams):
    def __init__(self, layout: HookLayout, dtype: torch.dtype, pin_memory: bool = False,
                 host_block_lifetime: int | None = None, pipeline_stages: Sequence[tuple[int, int]] | None = None,
                 prefix_rows: PrefixRows | None = None):
        """Streams as ``CaptureStreams`` takes them (``pipeline_stages``: each pipeline stage's
        ``[start, end)`` layers, None: one stage), and no request capturing yet. ``prefix_rows``:
        the activation store's use (None: no store, prefix hits stop at the first prompt row a
        destination needs)."""
        super().__init__(layout, dtype, pin_memory, host_block_lifetime, pipeline_stages)
        self.prefix_rows = prefix_rows
        self._copying_steps = 0  # steps planned with rows to record
        self.consumers: list[Any] = []
        self._token_readers = 0  # live requests whose own selection reads generated token ids
        self.requests_in_use = 0  # live requests with their own CaptureSpec
        self.rows_delivered = 0  # rows handed to streams and requests, counted per layer
        self._shortcuts: dict[str, SelectSpec] = {}  # "last_prompt", ... parsed once

    # ------------------------------------------------------------ admission

    def check(self, params: Any) -> None:
        """Refuse a bad ``params.capture`` (ValueError names the field) without holding anything:
        admission's checks run before any of a call's prompts runs."""
        self._request_destinations(params.capture, "")

    def admit(self, request: Request) -> None:
        """Validate ``params.capture`` and attach the request's capture state (ValueError names the field)."""
        destinations = self._request_destinations(request.params.capture, request.request_id)
        if destinations is None:
            return
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

    def _request_destinations(self, specs: Any, request_id: str) -> list[Destination] | None:
        """The destinations of a request's ``CaptureSpec``s (None: it captures nothing)."""
        if specs is None:
            return None
        if isinstance(specs, CaptureSpec):
            specs = [specs]
        if not isinstance(specs, (list, tuple)) or not all(isinstance(s, CaptureSpec) for s in specs):
            raise InvalidRequestError("capture: expected a CaptureSpec or a list of them")
        destinations = []
        for spec in specs:
            if spec.stream in (SAE_FEATURES, TRANSCODER_ERROR) and not any(d.component == spec.stream
                                                                           for d in destinations):
                destinations += self._feature_destinations(request_id, spec)
                continue
            named = spec.stream in (SAE_FEATURES, TRANSCODER_ERROR)
            component = spec.stream if named else self._component(spec.stream, "capture.stream")
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
            select = self._parse_select(spec.select)
            destinations.append(Destination(("request", request_id, component), component, hook,
                                            layers, dtype, select, None, spec.reduce, spec.budget_rows, heads))
        return destinations

    def _parse_select(self, select: Any) -> SelectSpec | None:
        """A request's ``select`` as a SelectSpec. A shortcut string parses to one shared spec, so its
        resolution per prompt length (kept by the spec) serves every request that names it."""
        if select is None:
            return None
        if isinstance(select, str) and select in self._shortcuts:
            return self._shortcuts[select]
        try:
            parsed = SelectSpec.parse(select)
        except ValueError as err:
            raise InvalidRequestError(f"capture.{err}") from None  # "capture.select...: ..."
        if isinstance(select, str):
            self._shortcuts[select] = parsed
        return parsed

    def _feature_destinations(self, request_id: str, spec: CaptureSpec) -> list[Destination]:
        select = self._parse_select(spec.select)
        check_reduction(spec.reduce, spec.budget_rows, "capture.")
        key = ("request", request_id, spec.stream)
        if spec.stream == TRANSCODER_ERROR:
            return self.features.error_destinations(spec.saes, select, key, spec.reduce, spec.budget_rows, "capture.")
        return self.features.destinations(spec.saes, spec.top_k, select, key, spec.reduce, spec.budget_rows,
                                          "capture.")

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

    def cache_limit(self, request: Request, hit_tokens: int) -> int:
        """How many of the ``hit_tokens`` leading tokens the prefix cache holds for ``request`` it
        may take: up to the first prompt row some destination still needs (rows below the
        high-water mark were already delivered) that the activation store does not serve."""
        limit = hit_tokens
        prompt_len = request.num_prompt_tokens
        done = request.max_computed_tokens
        if self.prefix_rows is not None:
            self.prefix_rows.forget(request)
        for destination in self._destinations(request):
            selector = self._selector(request, destination)
            first = selector.first_prompt_position(done, prompt_len)
            if first >= hit_tokens:
                continue
            if self.prefix_rows is not None:
                first = self.prefix_rows.cover(request, destination, selector, first, hit_tokens)
            limit = min(limit, first)
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
             query_start: np.ndarray) -> tuple[CapturePlan | None, Delivery] | None:
        """Which rows each destination records this step (None when none): the plain plan for the
        worker (None when only rows served from the activation store are delivered), and what
        delivery needs when the rows come back."""
        served = self.prefix_rows.serve(scheduled) if self.prefix_rows is not None else []
        if not served and not self.streams and not self.features.streams and not any(
                s.request.capture is not None and s.request.capture.destinations for s in scheduled):
            return None
        planned = plan_step(scheduled, positions, token_ids, query_start, self._destinations, self._selector,
                            self._serial)
        if planned is None:
            return (None, Delivery([], copying_step=self._copying_steps, served=served)) if served else None
        planned[1].copying_step = self._copying_steps
        planned[1].served = served
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
        if delivery.groups:
            if graphed:
                self.graph_replays += 1
            else:
                self.eager_capture_forwards += 1
        for served in delivery.served:  # below the step's own rows: first
            self._deliver_served(served, delivery.copying_step)
        for group, block in zip(delivery.groups, captured):
            group.fill_pending_tokens()
            if self.prefix_rows is not None:
                self.prefix_rows.keep(group, host_array(block))
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

    def _deliver_served(self, served: ServedRows, copying_step: int) -> None:
        """Rows a destination takes from the activation store: a request's own capture keeps them as
        a part (copied once when it finishes), a stream takes them as one block."""
        request, destination = served.request, served.destination
        if request.finished or request.paused:
            return
        self.rows_delivered += served.rows.count * len(destination.layers)
        if isinstance(destination.sink, RequestCapture):
            destination.sink.add(destination.key, served.rows, served.dtype, served.positions, served.token_ids)
            return
        block = as_tensor(parts_block([(served.rows, served.positions, served.token_ids)]), served.dtype)
        rows = StreamRows(block, np.arange(served.rows.count), [request.request_id],
                          np.array([served.rows.count]), served.positions, served.token_ids)
        if self.sink_thread is not None and getattr(destination.sink, "threaded", False):
            self.sink_thread.submit(copying_step, destination.sink.append, rows)
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
        if self.prefix_rows is not None:
            self.prefix_rows.forget(request)
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
            if destination.name is not None:  # sae_features and transcoder_error, keyed by SAE name
                features, meta = self.features.assemble(destination, parts, request.request_id)
                tensors.setdefault(component, {})[destination.name] = features
                metas.setdefault(component, {})[destination.name] = meta
                continue
            if component == ATTENTION_PATTERNS:
                tensors[component], metas[component] = assemble_patterns(request.request_id, destination, parts, dtype,
                                                                         self.windows, self.num_heads)
            else:
                tensors[component], metas[component] = assemble_rows(request.request_id, destination, parts, dtype,
                                                                     self.widths[component], self.dtype)
        for consumer in self.consumers:
            for component in tensors:
                if component not in (ATTENTION_PATTERNS, TRANSCODER_ERROR):  # consumers write [rows, width] tensors
                    consumer.on_capture(request.request_id, component, tensors[component], metas[component])
        return tensors, metas
