"""The driver half of SAE feature capture (the component ``sae_features``) and of a transcoder's
error node (``transcoder_error``).

Each registered SAE or transcoder is shipped to the worker once (``take_update``), under a key of
its name and registration, and each capture of it is a destination of its own: the rows at the
dictionary's point (a transcoder: at each of its layers), in a group the worker encodes
(``CaptureGroup.sae``), so prefix caching, chunked prefill, preemption and delivery treat feature
rows exactly as hidden-state rows. A stream per SAE (``start_capture("sae_features", saes=[...])``)
keeps its rows in a ``StreamStore`` of the SAE's layers; callers get ``SparseFeatures`` keyed by SAE
name, a multi-layer transcoder's rows merged into each row's highest features over its layers.
A transcoder's error node is captured per request (``CaptureSpec(stream="transcoder_error",
saes=[...])``): its decoders go to the worker with the first such request, and the rows come back
keyed by name, ``[rows, d_model]`` (``[rows, layers, d_model]`` for a transcoder of several layers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from steerable.capture.planner import Destination
from steerable.capture.request_rows import labels_of, parts_block
from steerable.capture.serialization import CaptureMeta
from steerable.capture.sparse import SparseFeatures
from steerable.capture.store import StreamConfig, StreamStore, reduce_rows
from steerable.checks import is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import TRANSCODER_ERROR
from steerable.sae.transcoder import Transcoder
from steerable.step import SaeUpdate, SaeWeights, TranscoderDecoders, TranscoderWeights

SAE_FEATURES = "sae_features"


def sae_weights(sae: Any, dtype: torch.dtype) -> SaeWeights:
    """What the worker needs of ``sae`` to encode rows, the encoder in the model dtype."""
    architecture = {"standard": "relu"}.get(sae.architecture, sae.architecture)
    return SaeWeights(sae.layer, sae.hook, architecture, sae.k or 0, sae.W_enc.detach().to("cpu", dtype).contiguous(),
                      sae.b_enc.detach().to("cpu", torch.float32).contiguous(),
                      None if sae.threshold is None else sae.threshold.detach().to("cpu", torch.float32).contiguous(),
                      sae.b_dec.detach().to("cpu", torch.float32).contiguous() if sae.apply_b_dec_to_input else None)


def transcoder_weights(transcoder: Transcoder, dtype: torch.dtype) -> TranscoderWeights:
    """What the worker needs of ``transcoder`` to encode rows: an encoder per source layer."""
    def encoder(s: int) -> SaeWeights:
        threshold = transcoder.threshold
        return SaeWeights(transcoder.layer + s, transcoder.hook, transcoder.architecture, transcoder.k or 0,
                          transcoder.W_enc[s].to("cpu", dtype).contiguous(),
                          transcoder.b_enc[s].to("cpu", torch.float32).contiguous(),
                          None if threshold is None else threshold[s].to("cpu", torch.float32).contiguous())

    return TranscoderWeights(transcoder.layer, transcoder.hook, [encoder(s) for s in range(transcoder.n_sources)])


def transcoder_decoders(transcoder: Transcoder, dtype: torch.dtype) -> TranscoderDecoders:
    skip = transcoder.W_skip
    return TranscoderDecoders([w.to("cpu", dtype).contiguous() for w in transcoder.W_dec],
                              transcoder.b_dec.to("cpu", torch.float32).contiguous(),
                              None if skip is None else skip.to("cpu", dtype).contiguous())


class FeatureCapture:
    """SAEs known to the worker, feature streams, and the checks of a feature capture request."""

    def __init__(self, dtype: torch.dtype, pin_memory: bool = False,
                 pipeline_stages: Sequence[tuple[int, int]] | None = None):
        """``pipeline_stages``: each pipeline stage's ``[start, end)`` layers (None: one stage)."""
        self.dtype = dtype
        self.pipeline_stages = pipeline_stages
        self.pin_memory = pin_memory
        self.saes: dict[str, tuple[str, Any]] = {}  # name -> (worker key, SAE)
        self._registrations = 0
        self._pending = SaeUpdate()
        self.streams: dict[str, Destination] = {}  # by SAE name, while recording
        self.stopped: dict[str, StreamStore] = {}
        self.stream_top_k: int | None = None
        self.users: Counter[str] = Counter()  # live requests capturing each SAE
        self._decoders_sent: set[str] = set()  # transcoders whose decoders the worker holds

    # ------------------------------------------------------------ registration (worker tables)

    def register(self, name: str, sae: Any) -> None:
        """Ship ``sae`` to the worker with the next step (replacing an SAE of that name)."""
        if name in self.saes:
            self.unregister(name)
        self._registrations += 1
        key = f"{name}#{self._registrations}"
        self.saes[name] = (key, sae)
        if isinstance(sae, Transcoder):
            self._pending.transcoders[key] = transcoder_weights(sae, self.dtype)
        else:
            self._pending.add[key] = sae_weights(sae, self.dtype)

    def unregister(self, name: str) -> None:
        key, _ = self.saes.pop(name)
        self.stopped.pop(name, None)
        self._decoders_sent.discard(name)
        self._pending.decoders.pop(key, None)
        if self._pending.add.pop(key, None) is None and self._pending.transcoders.pop(key, None) is None:
            self._pending.remove.append(key)

    def in_use(self, name: str) -> str | None:
        """Why ``name`` cannot be unregistered now (None: it can)."""
        if name in self.streams:
            return "the sae_features capture stream records it"
        if self.users[name]:
            return f"{self.users[name]} live request(s) capture its features"
        return None

    def take_update(self) -> SaeUpdate | None:
        update, self._pending = self._pending, SaeUpdate()
        return update if update.add or update.remove or update.transcoders or update.decoders else None

    # ------------------------------------------------------------ destinations

    def resolve(self, saes: Any, top_k: Any, prefix: str) -> list[tuple[str, str, Any]]:
        """(name, worker key, SAE) of each SAE asked for, ``top_k`` checked against each."""
        if isinstance(saes, str):
            saes = [saes]
        if not isinstance(saes, (list, tuple)) or not saes or not all(isinstance(s, str) for s in saes):
            raise InvalidRequestError(f"{prefix}saes: expected a non-empty list of registered SAE names, got {saes!r}")
        unknown = [s for s in saes if s not in self.saes]
        if unknown:
            raise InvalidRequestError(f"{prefix}saes: {unknown} are not registered SAEs; registered: "
                                      f"{sorted(self.saes)}")
        if len(set(saes)) != len(saes):
            raise InvalidRequestError(f"{prefix}saes: {list(saes)} names an SAE twice")
        resolved = [(name, *self.saes[name]) for name in saes]
        for name, _, sae in resolved:
            if not is_int(top_k) or not 1 <= top_k <= sae.d_sae:
                raise InvalidRequestError(f"{prefix}top_k: must be an integer in [1, {sae.d_sae}] (d_sae of {name!r}), "
                                          f"got {top_k!r}")
        return resolved

    def destinations(self, saes: Any, top_k: Any, select: Any, key: tuple, reduce: str, budget_rows: int | None,
                     prefix: str) -> list[Destination]:
        if reduce != "all":
            raise InvalidRequestError(f"{prefix}reduce: sae_features keeps every selected row (reduce='all'), "
                                      f"got {reduce!r}")
        return [Destination((*key, name), SAE_FEATURES, sae.hook, list(getattr(sae, "layers", [sae.layer])),
                            torch.float32, select, None, reduce, budget_rows, sae=worker_key, top_k=top_k, name=name)
                for name, worker_key, sae in self.resolve(saes, top_k, prefix)]

    def error_destinations(self, saes: Any, select: Any, key: tuple, reduce: str, budget_rows: int | None,
                           prefix: str) -> list[Destination]:
        """A request's ``transcoder_error`` captures, one per transcoder named; the decoders of each
        go to the worker with the next step if they have not yet."""
        resolved = self.resolve(saes, 1, prefix)
        for name, _, sae in resolved:
            if not isinstance(sae, Transcoder):
                raise InvalidRequestError(f"{prefix}saes: {name!r} is an SAE; {TRANSCODER_ERROR} needs transcoders")
            if sae.decodes_across(self.pipeline_stages):
                raise InvalidRequestError(f"{prefix}saes: {name!r} decodes from one pipeline stage's layers into "
                                          f"another's; its {TRANSCODER_ERROR} needs every layer it spans on one stage")
        for name, worker_key, sae in resolved:
            if name not in self._decoders_sent:
                self._decoders_sent.add(name)
                self._pending.decoders[worker_key] = transcoder_decoders(sae, self.dtype)
        return [Destination((*key, name), TRANSCODER_ERROR, TRANSCODER_ERROR, list(sae.layers), torch.float32,
                            select, None, reduce, budget_rows, sae=worker_key, name=name)
                for name, worker_key, sae in resolved]

    # ------------------------------------------------------------ streams

    def start(self, saes: Any, top_k: Any, select: Any, budget_rows: int | None, sink: Any, serial: int) -> None:
        config = StreamConfig([0], None, "all", select, budget_rows)  # errors name their field
        destinations = self.destinations(saes, top_k, config.select, ("stream", SAE_FEATURES, serial), "all",
                                         budget_rows, "")
        self.stop()
        for d in destinations:
            d.sink = sink if sink is not None else StreamStore(config, d.layers, {}, self.pin_memory)
            self.streams[d.name] = d
            if sink is None:
                self.stopped.pop(d.name, None)
        self.stream_top_k = top_k

    def stop(self) -> None:
        for name, destination in self.streams.items():
            if isinstance(destination.sink, StreamStore):
                self.stopped[name] = destination.sink
        self.streams.clear()

    def _stores(self) -> dict[str, StreamStore]:
        stores = dict(self.stopped)
        stores.update({n: d.sink for n, d in self.streams.items() if isinstance(d.sink, StreamStore)})
        return stores

    def fetch(self, clear: bool, names: Sequence[str] | None, req_ids: Sequence[str] | None
              ) -> tuple[dict[str, SparseFeatures], dict[str, CaptureMeta]]:
        stores = self._stores()
        if isinstance(names, str):
            names = [names]
        unknown = [n for n in names or () if n not in stores]
        if unknown:
            raise InvalidRequestError(f"saes: {unknown} are not captured by the sae_features stream; captured: "
                                      f"{sorted(stores)}")
        tensors, metas = {}, {}
        for name in names if names is not None else sorted(stores):
            store = stores[name]
            rows, labels = store.fetch(None, list(req_ids) if req_ids is not None else None, clear_selected=clear)
            if rows:  # one packed block per layer, merged over a transcoder's layers
                tensors[name] = SparseFeatures.unpack_layers(torch.stack([rows[layer] for layer in sorted(rows)]))
            for meta in labels.values():
                metas[name] = meta
        return tensors, metas

    def clear(self) -> None:
        for store in self._stores().values():
            store.clear()

    def status(self) -> dict[str, Any]:
        stores = self._stores()
        return {"enabled": bool(self.streams), "stream": SAE_FEATURES, "saes": sorted(self.streams),
                "top_k": self.stream_top_k if self.streams else None,
                "hooked_layers": sorted({sae.layer for _, sae in self.saes.values()}),
                "layouts": self.layouts(),
                "rows_stored": {n: s.tokens_stored for n, s in stores.items()},
                "tokens_stored": sum(s.tokens_stored for s in stores.values()),
                "tokens_dropped": sum(s.tokens_dropped for s in stores.values())}

    def layouts(self) -> dict[str, dict[str, Any]]:
        """Per registered SAE, what its captured rows describe."""
        return {name: {**sae.describe(), "d_in": sae.d_in} for name, (_, sae) in self.saes.items()}

    # ------------------------------------------------------------ a request's rows

    def assemble(self, destination: Destination, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                 request_id: str) -> tuple[SparseFeatures | torch.Tensor, CaptureMeta]:
        """A finished request's feature (or error node) rows, position order, and labels, at most
        ``budget_rows``."""
        if destination.component == TRANSCODER_ERROR:
            return self._assemble_error(destination, parts, request_id)
        if parts:
            packed = torch.from_numpy(parts_block(parts))
            positions, token_ids = labels_of(parts)
            features = SparseFeatures.unpack_layers(packed)
        else:
            features = SparseFeatures.empty(destination.top_k)
            positions = token_ids = np.empty(0, np.int32)
        if destination.budget_rows is not None:
            keep = destination.budget_rows
            features, positions, token_ids = features.select(slice(0, keep)), positions[:keep], token_ids[:keep]
        return features, CaptureMeta([request_id] * len(positions), torch.from_numpy(positions),
                                     torch.from_numpy(token_ids))

    def _assemble_error(self, destination: Destination, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                        request_id: str) -> tuple[torch.Tensor, CaptureMeta]:
        """Error rows ``[rows, layers, d_model]``, ``[rows, d_model]`` for one layer, reduced as asked."""
        layers = len(destination.layers)
        if parts:
            rows = torch.from_numpy(parts_block(parts)).transpose(0, 1)
            positions, token_ids = labels_of(parts)
        else:
            rows = torch.empty(0, layers, self.saes[destination.name][1].d_out, dtype=torch.float32)
            positions = token_ids = np.empty(0, np.int32)
        rows, positions, token_ids = reduce_rows(rows, positions, token_ids, destination.reduce,
                                                 destination.budget_rows, torch.float32)
        if layers == 1:
            rows = rows[:, 0]
        return rows.contiguous(), CaptureMeta([request_id] * len(positions), torch.from_numpy(positions),
                                              torch.from_numpy(token_ids))
