"""Capture streams, the engine-wide half of the capture plane: starting, stopping, fetching and
describing a stream, and the checks a capture request's fields share with them (which components
and layers the model offers). ``CaptureSession`` adds the per-request half: admission, each step's
plan and the delivery of its rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from steerable.capture.features import SAE_FEATURES, FeatureCapture
from steerable.capture.planner import Destination
from steerable.capture.serialization import CaptureMeta
from steerable.capture.sink_thread import SinkThread
from steerable.capture.store import StreamConfig, StreamStore
from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import (
    ATTENTION_PATTERNS,
    COMPONENTS,
    HIDDEN_STATES,
    POST_MLP,
    ROUTER_LOGITS,
    TRANSCODER_ERROR,
    HookLayout,
    check_hook_point,
)
from steerable.selection import SelectSpec


class CaptureStreams:
    def __init__(self, layout: HookLayout, dtype: torch.dtype, pin_memory: bool = False,
                 host_block_lifetime: int | None = None, pipeline_stages: Sequence[tuple[int, int]] | None = None):
        """``layout``: the components the model offers and where; ``dtype``: the model's, for rows
        stored without a dtype of their own; ``pin_memory``: streams keep rows in pinned host memory
        (a CUDA machine: resident pages, no first-touch faults while a step's rows are stored);
        ``host_block_lifetime``: how many later copying launches a step's host rows survive (the
        worker's ``host_block_lifetime``; None: threaded sinks are fed on the engine's thread);
        ``pipeline_stages``: each pipeline stage's ``[start, end)`` layers (None: one stage)."""
        self.pin_memory = pin_memory
        self.host_block_lifetime = host_block_lifetime
        self.sink_thread: SinkThread | None = None  # while a threaded sink is running
        self.available = {name: list(c.layers) for name, c in layout.components.items()}
        self.widths = {name: c.width for name, c in layout.components.items()}
        self.layouts = {name: c.describe() for name, c in layout.components.items()}
        patterns = self.layouts.get(ATTENTION_PATTERNS, {})
        self.windows = {layer: info["sliding_window"] for layer, info in patterns.items()}
        self.num_heads = next(iter(patterns.values()))["num_heads"] if patterns else 0
        self.dtype = dtype
        self.features = FeatureCapture(dtype, pin_memory, pipeline_stages)
        self.streams: dict[str, Destination] = {}
        self.stopped: dict[str, StreamStore] = {}
        self._serial = 0  # bumps when a stream starts or stops: cached per-request plans go stale
        self.graph_replays = 0
        self.eager_capture_forwards = 0

    # ------------------------------------------------------------ validation helpers

    def _component(self, stream: str, field_name: str = "stream") -> str:
        if stream == TRANSCODER_ERROR:  # needs each request's rows of every layer together
            raise InvalidRequestError(f"{field_name}: {TRANSCODER_ERROR!r} is captured per request "
                                      "(SamplingParams(capture=CaptureSpec(stream='transcoder_error', saes=[...]))), "
                                      "not as a stream")
        if stream not in COMPONENTS:
            raise InvalidRequestError(f"{field_name}: unknown capture stream {stream!r}; expected one of "
                                      f"{[*COMPONENTS, SAE_FEATURES, TRANSCODER_ERROR]}")
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
        return component if component != HIDDEN_STATES else check_hook_point(hook, field_name)

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
