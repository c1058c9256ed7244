"""``ControlVector``: one direction per layer at one hook point, the unit a researcher trains,
scales, combines, saves and steers with (llama.cpp's and repeng's "control vector")."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP, RESIDUAL_POINTS
from steerable.steering.spec import Add, SteeringSpec


@dataclass(eq=False)
class ControlVector:
    """``directions[layer]`` (float32 CPU tensors of one width) added at ``hook`` of each layer.

    ``metadata`` carries what training knew: ``model_hint`` (the HF ``model_type``), ``method``,
    ``layers``, ``pairs``, ``token`` and ``residual_norm`` (mean L2 norm of the residual stream at
    each layer, so ``to_spec(relative=True)`` can express strength as a fraction of it).
    """

    directions: dict[int, torch.Tensor]
    hook: str = POST_MLP
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hook not in RESIDUAL_POINTS:
            raise InvalidRequestError(f"hook: unknown hook {self.hook!r}; expected one of {list(RESIDUAL_POINTS)}")
        if not isinstance(self.directions, Mapping) or not self.directions:
            raise InvalidRequestError("directions: expected a non-empty {layer: vector} dict")
        checked: dict[int, torch.Tensor] = {}
        for layer, vector in self.directions.items():
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise InvalidRequestError(f"directions: layer {layer!r} is not a non-negative integer")
            tensor = torch.as_tensor(vector).detach().to("cpu", torch.float32).clone()  # owned by the vector
            if tensor.ndim != 1:
                raise InvalidRequestError(f"directions[{layer}]: expected a 1-D vector, got shape "
                                          f"{tuple(tensor.shape)}")
            if not torch.isfinite(tensor).all():
                raise InvalidRequestError(f"directions[{layer}]: contains NaN or Inf")
            checked[layer] = tensor
        widths = {t.numel() for t in checked.values()}
        if len(widths) != 1:
            raise InvalidRequestError(f"directions: every layer must have the same width, got {sorted(widths)}")
        self.directions = dict(sorted(checked.items()))
        self.metadata = dict(self.metadata)

    # ------------------------------------------------------------ shape

    @property
    def layers(self) -> list[int]:
        return list(self.directions)

    @property
    def width(self) -> int:
        return next(iter(self.directions.values())).numel()

    def in_layer_range(self, start: int, end: int) -> "ControlVector":
        """Only the layers in [start, end] (inclusive, as llama.cpp's ``--control-vector-layer-range``)."""
        kept = {layer: v for layer, v in self.directions.items() if start <= layer <= end}
        if not kept:
            raise InvalidRequestError(f"layer_range: [{start}, {end}] keeps none of the layers {self.layers}")
        return self._with(kept)

    # ------------------------------------------------------------ arithmetic (as repeng's)

    def __neg__(self) -> "ControlVector":
        return self * -1.0

    def __mul__(self, scale: float) -> "ControlVector":
        scale = _scalar(scale)
        return self._with({layer: v * scale for layer, v in self.directions.items()})

    __rmul__ = __mul__

    def __truediv__(self, scale: float) -> "ControlVector":
        scale = _scalar(scale)
        if scale == 0.0:
            raise InvalidRequestError("scale: cannot divide a control vector by zero")
        return self * (1.0 / scale)

    def __add__(self, other: "ControlVector") -> "ControlVector":
        """Per-layer sum; a layer only one side has is kept as it is (llama.cpp sums files this way)."""
        if not isinstance(other, ControlVector):
            return NotImplemented
        if other.hook != self.hook:
            raise InvalidRequestError(f"hook: cannot add a {other.hook} vector to a {self.hook} vector")
        if other.width != self.width:
            raise InvalidRequestError(f"width: cannot add a {other.width}-wide vector to a {self.width}-wide one")
        summed = dict(self.directions)
        for layer, v in other.directions.items():
            summed[layer] = summed[layer] + v if layer in summed else v
        norms = {**other.metadata.get("residual_norm", {}), **self.metadata.get("residual_norm", {})}
        metadata = {**other.metadata, **self.metadata, "layers": sorted(summed)}
        if norms:
            metadata["residual_norm"] = norms
        return ControlVector(summed, self.hook, metadata)

    def __sub__(self, other: "ControlVector") -> "ControlVector":
        return self + (-other)

    # ------------------------------------------------------------ steering

    def normalized(self, relative: bool = False) -> "ControlVector":
        """Unit vectors per layer; with ``relative=True`` each has the length of that layer's mean
        residual norm instead, so ``cv.normalized(True) * 0.1`` pushes by 10 % of the stream."""
        if relative:
            norms = self.metadata.get("residual_norm") or {}
            missing = [layer for layer in self.directions if layer not in norms]
            if missing:
                raise InvalidRequestError(f"relative: no mean residual norm for layers {missing} (vectors trained "
                                          "with steerable.vectors.train carry them; GGUF files do not)")
        else:
            norms = {}
        scaled = {}
        for layer, v in self.directions.items():
            length = float(v.norm())
            scaled[layer] = v * (norms.get(layer, 1.0) / length) if length > 0 else v.clone()
        return self._with(scaled)

    def to_spec(self, scale: float = 1.0, relative: bool = False, select: Any = None) -> SteeringSpec:
        """A ``SteeringSpec`` adding ``scale * direction`` at ``hook`` of each layer on the rows
        ``select`` picks (default: every token); with ``relative=True``, ``scale`` is a fraction of
        each layer's mean residual norm."""
        source = self.normalized(relative=True) if relative else self
        scale = _scalar(scale)
        return SteeringSpec(interventions=[Add(layer, v * scale, self.hook, select=select)
                                           for layer, v in source.directions.items()])

    def check_model(self, hidden_size: int, num_layers: int, where: str = "control vector") -> None:
        """Fail naming the width or the layers when this vector does not fit a model."""
        if self.width != hidden_size:
            raise InvalidRequestError(f"{where}: width {self.width} does not match the model's hidden size "
                                      f"{hidden_size}")
        outside = [layer for layer in self.directions if layer >= num_layers]
        if outside:
            raise InvalidRequestError(f"{where}: layers {outside} do not exist in a model of {num_layers} layers")

    # ------------------------------------------------------------ files

    def save(self, path: str | os.PathLike) -> None:
        """``.gguf`` (llama.cpp / repeng control vector) or ``.safetensors`` (keeps hook and metadata)."""
        from steerable.vectors import files
        files.save(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, llm: Any = None) -> "ControlVector":
        """Read a ``.gguf`` or ``.safetensors`` control vector; with ``llm``, also check that its
        width and layers fit that model (``InvalidRequestError`` naming them)."""
        from steerable.vectors import files
        cv = files.load(path)
        if llm is not None:
            cfg = llm.llm_engine.model_config
            cv.check_model(cfg.hidden_size, cfg.num_layers, where=str(path))
        return cv

    def _with(self, directions: dict[int, torch.Tensor]) -> "ControlVector":
        return ControlVector(directions, self.hook, {**self.metadata, "layers": sorted(directions)})

    def __repr__(self) -> str:
        method = self.metadata.get("method")
        return (f"ControlVector(hook={self.hook!r}, layers={_ranges(self.layers)}, width={self.width}"
                f"{f', method={method!r}' if method else ''})")


def _scalar(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidRequestError(f"scale: expected a finite number, got {value!r}")
    return float(value)


def _ranges(layers: Iterable[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``'2-4,7'`` for a short repr."""
    parts: list[list[int]] = []
    for layer in layers:
        if parts and layer == parts[-1][-1] + 1:
            parts[-1].append(layer)
        else:
            parts.append([layer])
    return ",".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)
