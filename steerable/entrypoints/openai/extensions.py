"""The steering and capture fields of a request body (top-level, ``extra_body`` in the OpenAI SDK)
and the captures of a response: JSON in, engine objects out, and back.

- ``steering_vectors``: every form ``SamplingParams(steering_vectors=...)`` takes, as JSON
  (``steerable.steering.wire``), vectors as float lists or base64.
- ``steering_module_ref``: ``"name"`` or ``{"name": ..., "scale": ...}``.
- ``capture``: a ``CaptureSpec`` as a dict (``component`` or ``stream`` names the stream), or a list
  of them; ``{"stream": "sae_features", "saes": [...], "top_k": 32, "select": ...}`` captures SAE
  features of registered SAEs (and transcoders), ``{"stream": "transcoder_error", "saes": [...]}``
  transcoders' error nodes.
Unknown keys are a 400 naming the key, and so is an unknown top-level key that begins with
``steer`` or ``capture``: a typo must not silently run unsteered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steerable.capture.features import SAE_FEATURES
from steerable.capture.serialization import serialize_captured
from steerable.capture.session import CaptureSpec
from steerable.capture.store import resolve_storage_dtype
from steerable.errors import InvalidRequestError
from steerable.hook_points import ATTENTION_PATTERNS, COMPONENTS, HIDDEN_STATES, POST_MLP, TRANSCODER_ERROR
from steerable.outputs import CompletionOutput
from steerable.selection import SelectSpec

EXTENSION_FIELDS = ("steering_vectors", "steering_module_ref", "capture")
CAPTURE_KEYS = ("component", "stream", "layers", "hook", "select", "reduce", "dtype", "budget_rows", "heads", "saes",
                "top_k")


def reject_unknown_extensions(extra: Iterable[str]) -> None:
    """Top-level keys outside the OpenAI fields: ``steer*`` / ``capture*`` typos are errors."""
    for key in extra:
        if key.startswith(("steer", "capture")):
            raise InvalidRequestError(f"{key}: unknown field; the steering and capture fields are "
                                      f"{', '.join(EXTENSION_FIELDS)}")


def module_ref_from_json(value: Any) -> str | tuple[str, float] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"name", "scale"})
        if unknown:
            raise InvalidRequestError(f"steering_module_ref.{unknown[0]}: unknown key; expected 'name' and 'scale'")
        if "name" not in value:
            raise InvalidRequestError("steering_module_ref.name: missing")
        return value["name"], value.get("scale", 1.0)
    raise InvalidRequestError(f"steering_module_ref: expected a name or {{'name', 'scale'}}, "
                              f"got {type(value).__name__}")


def capture_from_json(value: Any) -> list[CaptureSpec] | None:
    if value is None:
        return None
    specs = value if isinstance(value, list) else [value]
    out = []
    for i, spec in enumerate(specs):
        where = "capture" if not isinstance(value, list) else f"capture[{i}]"
        if not isinstance(spec, dict):
            raise InvalidRequestError(f"{where}: expected a dict (or a list of them), got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(CAPTURE_KEYS))
        if unknown:
            raise InvalidRequestError(f"{where}.{unknown[0]}: unknown key; expected one of {list(CAPTURE_KEYS)}")
        if "component" in spec and "stream" in spec:
            raise InvalidRequestError(f"{where}.stream: give 'stream' or its alias 'component', not both")
        key = "stream" if "stream" in spec else "component"
        component = spec.get(key, HIDDEN_STATES)
        if component not in (*COMPONENTS, SAE_FEATURES, TRANSCODER_ERROR):
            raise InvalidRequestError(f"{where}.{key}: unknown component {component!r}; expected one of "
                                      f"{[*COMPONENTS, SAE_FEATURES, TRANSCODER_ERROR]}")
        out.append(CaptureSpec(stream=component, layers=spec.get("layers"), select=spec.get("select"),
                               dtype=spec.get("dtype"), hook=spec.get("hook", POST_MLP),
                               reduce=spec.get("reduce", "all"), budget_rows=spec.get("budget_rows"),
                               heads=spec.get("heads"), saes=spec.get("saes"),
                               top_k=spec.get("top_k", 32)))
    return out


@dataclass
class CaptureInfo:
    """What the model offers per component: capturable layers, row width, layouts; and the
    model's dtype (the default storage dtype)."""

    layers: dict[str, list[int]]
    widths: dict[str, int]
    layouts: dict[str, dict[int, dict]]
    dtype: torch.dtype

    def bytes_bound(self, specs: Sequence[CaptureSpec] | None, prompt: list[int], max_tokens: int) -> int:
        """Most bytes one completion's captures can take (rows are token inputs: at most the prompt
        plus ``max_tokens - 1`` generated ones). A spec the engine will reject counts 0."""
        total = 0
        for spec in specs or ():
            try:
                total += self._spec_bytes(spec, prompt, max_tokens)
            except (ValueError, TypeError):
                continue
        return total

    def _spec_bytes(self, spec: CaptureSpec, prompt: list[int], max_tokens: int) -> int:
        if spec.reduce in ("last", "mean"):
            rows = 1
        else:
            select = SelectSpec.parse(spec.select) if spec.select is not None else None
            prompt_rows = len(prompt) if select is None else len(select.prompt_positions_selected(prompt))
            generated = select is None or select.may_select_generation()
            rows = prompt_rows + (max_tokens - 1 if generated else 0)
        if spec.budget_rows is not None:
            rows = min(rows, int(spec.budget_rows))
        if spec.stream == ATTENTION_PATTERNS:  # a row: its heads times at most every key before it
            heads = self.widths.get(spec.stream, 0) if spec.heads is None else len(set(spec.heads))
            keys = len(prompt) + max(max_tokens, 1)
            itemsize = (resolve_storage_dtype(spec.dtype) or torch.float32).itemsize
            return rows * self._layer_count(spec) * heads * keys * itemsize
        return rows * self._row_bytes(spec)

    def _layer_count(self, spec: CaptureSpec) -> int:
        layers = self.layers.get(spec.stream, [])
        return len(layers) if spec.layers is None else len({spec.layers} if isinstance(spec.layers, int)
                                                           else set(spec.layers))

    def _row_bytes(self, spec: CaptureSpec) -> int:
        """Bytes of one captured row over every layer (every SAE) the spec reads."""
        if spec.stream == SAE_FEATURES:  # per SAE: top_k int32 indices and float32 values
            return len([spec.saes] if isinstance(spec.saes, str) else spec.saes) * 2 * int(spec.top_k) * 4
        if spec.stream == TRANSCODER_ERROR:  # per transcoder: float32 rows at (at most) every layer
            hidden = self.widths.get(HIDDEN_STATES, 0) * len(self.layers.get(HIDDEN_STATES, []))
            return len([spec.saes] if isinstance(spec.saes, str) else spec.saes) * hidden * 4
        count = self._layer_count(spec)
        dtype = resolve_storage_dtype(spec.dtype) or (torch.float32 if spec.reduce == "mean" else self.dtype)
        return count * self.widths.get(spec.stream, 0) * dtype.itemsize

    def to_json(self, completion: CompletionOutput) -> dict[str, Any]:
        """A finished completion's captures: ``{component: {"<layer>": wire}}`` with base64 data,
        which ``steerable.capture.deserialize_captured`` reads as it is."""
        return {component: serialize_captured(tensors, completion.capture_meta[component],
                                              self.layouts.get(component), text=True)
                for component, tensors in completion.captures.items()}
