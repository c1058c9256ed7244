"""``Generate`` and ``Capture``: steerable as Ray Data transforms, one engine per actor.

Both are callable classes for ``Dataset.map_batches``: Ray builds one per actor (``__init__``
loads the model once), then calls it on batch after batch, so the engine, its registered SAEs and
steering modules live as long as the actor. Inside a batch the rows run together through the
engine's continuous batching, exactly as ``LLM.generate`` runs a list of prompts, so a row's
output is the one ``LLM.generate`` / ``steerable.capture`` gives for it offline.

``Generate``: a row is a prompt (``prompt``, ``messages`` or ``prompt_token_ids``) with optional
``sampling_params`` (a dict of ``SamplingParams`` fields), ``steering`` (what the server takes as
``steering_vectors``), ``steering_module_ref`` and ``capture`` (the server's JSON); it comes back
with its other input columns (the prompt's among them) plus ``request_id``,
``prompt_token_ids``, ``generated_text``, ``token_ids``, ``finish_reason`` and its captures
(``rows.capture_arrays``).

``Capture``: the corpus capture (``capture_corpus``) as a transform; a row is a text (or token ids)
and one output row comes back per captured token, as the corpus shards hold them (``layer.L`` per
layer, or ``indices``/``values`` of an SAE's features, with ``position`` and ``token_id``), each
carrying the input row's other columns, so ``iter_torch_batches(batch_size=B)`` is a stream of
activation batches.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from steerable.capture.api import capture
from steerable.capture.features import SAE_FEATURES
from steerable.entrypoints.llm import LLM, run_to_completion
from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP
from steerable.ray.rows import (batch_columns, capture_arrays, carried, missing, num_rows, objects, plain, ragged_columns,
                                row_params, row_prompt, to_numpy)
from steerable.sae import SAE
from steerable.sampling_params import SamplingParams
from steerable.steering.wire import steering_from_json

CAPTURE_INPUTS = ("text", "prompt", "prompt_token_ids", "token_ids")
# Columns that configure a row's request: consumed, not carried to the output (steering vectors
# are large, and rows of different shapes would give each output block a struct of its own).
REQUEST_FIELDS = ("sampling_params", "steering", "steering_module_ref", "capture")


def _engine(model: str, engine_kwargs: Mapping[str, Any] | None, saes: Mapping[str, str] | None) -> LLM:
    llm = LLM(model, **dict(engine_kwargs or {}))
    for name, path in (saes or {}).items():
        llm.register_sae(name, SAE.load(path))
    return llm


class Generate:
    """Batch generation with steering and capture (see the module docstring). ``sampling_params``:
    the fields a row without its own gets (a row's own update them); ``capture``: the capture
    JSON of rows without one; ``steering_modules``: ``{name: steering JSON}`` registered for
    ``steering_module_ref``; ``saes``: ``{name: path}`` registered for feature steering and
    capture."""

    def __init__(self, model: str, engine_kwargs: Mapping[str, Any] | None = None,
                 sampling_params: Mapping[str, Any] | None = None, capture: Any = None,
                 steering_modules: Mapping[str, Any] | None = None, saes: Mapping[str, str] | None = None):
        self.defaults = dict(sampling_params or {})
        SamplingParams(**self.defaults).validate()  # a bad default fails here, not on the first batch
        self.capture = capture
        self.llm = _engine(model, engine_kwargs, saes)
        if steering_modules:
            self.llm.register_steering_modules({name: steering_from_json(spec, f"steering_modules.{name}")
                                                for name, spec in steering_modules.items()})

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = batch_columns(batch)
        n = num_rows(columns)
        if n == 0:
            return columns
        engine = self.llm.llm_engine
        prompts = [row_prompt(columns, i, engine.tokenizer) for i in range(n)]
        params = [row_params(columns, i, self.defaults, self.capture) for i in range(n)]
        ids = _request_ids(columns.get("request_id"), n)
        outputs = run_to_completion(engine, ids, False, engine.queue_requests(list(zip(ids, prompts, params))))
        out = {name: carried(column) for name, column in columns.items() if name not in REQUEST_FIELDS}
        out["request_id"] = objects(ids)
        out["prompt_token_ids"] = objects([np.asarray(o.prompt_token_ids, np.int64) for o in outputs])
        out["generated_text"] = objects([o.outputs[0].text for o in outputs])
        out["token_ids"] = objects([np.asarray(o.outputs[0].token_ids, np.int64) for o in outputs])
        out["finish_reason"] = objects([o.outputs[0].finish_reason for o in outputs])
        out.update(ragged_columns([capture_arrays(o) for o in outputs]))
        return out


def _request_ids(given: np.ndarray | None, n: int) -> list[str]:
    """The rows' own ``request_id`` where they have one (they label the captured rows), else new ones."""
    ids = [uuid.uuid4().hex if given is None or missing(given[i]) else str(given[i]) for i in range(n)]
    if len(set(ids)) != n:
        raise InvalidRequestError("request_id: the rows of a batch need distinct ids")
    return ids


class Capture:
    """Corpus capture as a transform (see the module docstring): ``hook`` at ``layers`` (default
    all) on the rows ``select`` picks (default the last prompt token), stored as ``dtype`` (default
    the model's; bfloat16 comes out as float32), or with ``sae`` (a name in ``saes``: ``{name:
    path}``) the ``top_k`` highest features of that SAE. ``column``: the input column (default the
    first of ``text``, ``prompt``, ``prompt_token_ids``, ``token_ids`` the batch has)."""

    def __init__(self, model: str, layers: Sequence[int] | None = None, hook: str = POST_MLP,
                 select: Any = "last_prompt", dtype: str | None = None, column: str | None = None,
                 sae: str | None = None, top_k: int = 64, saes: Mapping[str, str] | None = None,
                 engine_kwargs: Mapping[str, Any] | None = None):
        if sae is not None and sae not in (saes or {}):
            raise InvalidRequestError(f"sae: {sae!r} is not one of the SAEs given in saes ({sorted(saes or {})})")
        self.layers, self.hook, self.select, self.dtype = layers, hook, select, dtype
        self.column, self.sae, self.top_k = column, sae, top_k
        self.llm = _engine(model, engine_kwargs, saes)

    def __call__(self, batch: Any) -> dict[str, np.ndarray]:
        columns = batch_columns(batch)
        name = self._input_column(columns)
        n = num_rows(columns)
        if n == 0:
            return {k: v for k, v in columns.items() if k != name}
        prompts = [_corpus_prompt(columns[name][i], name, i) for i in range(n)]
        if self.sae is None:
            result = capture(self.llm, prompts, layers=self.layers, hook=self.hook, select=self.select,
                             dtype=self.dtype)
            data = {f"layer.{layer}": to_numpy(result.rows(layer)) for layer in result.layer_ids}
        else:
            result = capture(self.llm, prompts, stream=SAE_FEATURES, saes=[self.sae], top_k=self.top_k,
                             select=self.select)
            features = result.rows(self.sae)
            data = {"indices": features.indices.numpy(), "values": features.values.numpy()}
        key = result.layer_ids[0]
        meta = result.meta(key)
        counts = [len(out.capture_meta[result.stream][key]) for out in result.outputs]
        source = np.repeat(np.arange(n), counts)
        out = {k: carried(v[source]) for k, v in columns.items() if k != name}
        out["position"], out["token_id"] = meta.positions.numpy(), meta.token_ids.numpy()
        out.update(data)
        return out

    def _input_column(self, columns: Mapping[str, np.ndarray]) -> str:
        if self.column is not None:
            if self.column not in columns:
                raise InvalidRequestError(f"column: the batch has no column {self.column!r} (it has {sorted(columns)})")
            return self.column
        for name in CAPTURE_INPUTS:
            if name in columns:
                return name
        raise InvalidRequestError(f"column: the batch has none of {list(CAPTURE_INPUTS)} (it has {sorted(columns)}); "
                                  "name the input column with column=")


def _corpus_prompt(value: Any, column: str, i: int) -> str | list[int]:
    if isinstance(value, str):
        return value
    ids = plain(value, f"row {i}: {column}", ints=True)
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError(f"row {i}: {column}: expected a string or a non-empty list of token ids")
    return ids
