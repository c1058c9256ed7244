"""What users write to steer (``Add``, ``Clamp``, ``SteeringSpec`` and the dict shorthands), and its
validated, canonical form (``Intervention``) that the engine composes, hashes and loads into tables."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.hook_points import POST_MLP, RESIDUAL_POINTS
from steerable.selection import SelectSpec

PREFILL = SelectSpec(prompt="all")
DECODE = SelectSpec(generation="all")


@dataclass(frozen=True)
class Add:
    """``h += scale * vector`` at ``hook`` of ``layer`` on the selected rows."""

    layer: int
    vector: Any
    hook: str = POST_MLP
    scale: float = 1.0
    select: Any = None


@dataclass(frozen=True)
class Clamp:
    """Clamp the projection of ``h`` on the unit ``direction`` to [min, max]:
    ``p = h·d; h += strength * (clip(p, min, max) - p) * d``. ``min=max=0`` ablates the direction."""

    layer: int
    direction: Any
    hook: str = POST_MLP
    min: float | None = None
    max: float | None = None
    strength: float = 1.0
    select: Any = None


@dataclass
class SteeringSpec:
    """A list of interventions plus the tiered shorthands: ``vectors`` (every token),
    ``prefill_vectors`` (prompt rows), ``decode_vectors`` (generated rows), ``clamps``; ``scale``
    multiplies every additive vector and every clamp strength."""

    interventions: list[Add | Clamp] = field(default_factory=list)
    vectors: Any = None
    prefill_vectors: Any = None
    decode_vectors: Any = None
    clamps: list[Clamp] | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class Intervention:
    """Canonical, validated form: float32 CPU vectors, scale folded in, selection parsed."""

    kind: str  # "add" | "clamp"
    point: str
    layer: int
    vector: torch.Tensor  # add: the vector to add; clamp: the unit direction
    select: SelectSpec | None
    lo: float = -math.inf
    hi: float = math.inf
    strength: float = 1.0

    @property
    def site(self) -> tuple[str, int]:
        return self.point, self.layer

    def scaled(self, scale: float, where: str) -> "Intervention":
        if self.kind == "add":
            return Intervention("add", self.point, self.layer, self.vector * scale, self.select)
        strength = self.strength * scale
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"{where}: clamp strength {self.strength} x scale {scale} is outside [0, 1]")
        return Intervention("clamp", self.point, self.layer, self.vector, self.select, self.lo, self.hi, strength)

    def is_noop(self) -> bool:
        if self.kind == "add":
            return not bool(self.vector.any())
        return self.strength == 0.0

    @functools.cached_property
    def digest(self) -> bytes:
        """Content hash, computed once per intervention (a global spec is shared by every request)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{self.kind}|{self.point}|{self.layer}|{self.lo}|{self.hi}|{self.strength}|".encode())
        h.update(self.select.key.encode() if self.select is not None else b"*")
        h.update(self.vector.numpy().tobytes())
        return h.digest()


def config_identity(interventions: Sequence[Intervention]) -> bytes:
    """Order-independent hash of a composed config: equal configs share rows and cache blocks."""
    h = hashlib.blake2b(digest_size=16)
    for d in sorted(item.digest for item in interventions):
        h.update(d)
    return h.digest()


class SpecParser:
    """Validates user specs against one model (hidden size, layer count) and normalises them."""

    def __init__(self, hidden_size: int, num_layers: int):
        self.hidden_size = hidden_size
        self.num_layers = num_layers

    def parse(self, spec: Any, where: str) -> list[Intervention]:
        """Any accepted form -> interventions; ``ValueError`` names ``where`` and the bad part."""
        if spec is None:
            return []
        if isinstance(spec, (Add, Clamp)):
            spec = [spec]
        if isinstance(spec, SteeringSpec):
            return self._parse_spec(spec, where)
        if isinstance(spec, Mapping):
            return self._parse_vectors(spec, None, where)
        if isinstance(spec, (list, tuple)) and all(isinstance(i, (Add, Clamp)) for i in spec):
            return [self._parse_item(item, f"{where}[{i}]") for i, item in enumerate(spec)]
        raise ValueError(f"{where}: expected a SteeringSpec, Add/Clamp items or a dict of vectors, "
                         f"got {type(spec).__name__}")

    def _parse_spec(self, spec: SteeringSpec, where: str) -> list[Intervention]:
        scale = _number(spec.scale, f"{where}.scale")
        items = [self._parse_item(item, f"{where}.interventions[{i}]") for i, item in enumerate(spec.interventions)]
        items += self._parse_vectors(spec.vectors, None, f"{where}.vectors")
        items += self._parse_vectors(spec.prefill_vectors, PREFILL, f"{where}.prefill_vectors")
        items += self._parse_vectors(spec.decode_vectors, DECODE, f"{where}.decode_vectors")
        for i, clamp in enumerate(spec.clamps or []):
            if not isinstance(clamp, Clamp):
                raise ValueError(f"{where}.clamps[{i}]: expected a Clamp, got {type(clamp).__name__}")
            items.append(self._parse_item(clamp, f"{where}.clamps[{i}]"))
        return [item.scaled(scale, f"{where}.scale") for item in items] if scale != 1.0 else items

    def _parse_vectors(self, vectors: Any, select: SelectSpec | None, where: str) -> list[Intervention]:
        """``{layer: v}`` (post_mlp) or ``{hook: {layer: v | {"vector": v, "scale": s}}}``."""
        if vectors is None:
            return []
        if not isinstance(vectors, Mapping):
            raise ValueError(f"{where}: expected a dict of vectors, got {type(vectors).__name__}")
        if vectors and all(isinstance(k, str) and not k.lstrip("-").isdigit() for k in vectors):
            by_hook = vectors
        else:
            by_hook = {POST_MLP: vectors}
        items = []
        for hook, layers in by_hook.items():
            if not isinstance(layers, Mapping):
                raise ValueError(f"{where}.{hook}: expected {{layer: vector}}, got {type(layers).__name__}")
            for layer, entry in layers.items():
                here = f"{where}.{hook}[{layer}]"
                scale = 1.0
                if isinstance(entry, Mapping):
                    unknown = set(entry) - {"vector", "scale"}
                    if unknown or "vector" not in entry:
                        raise ValueError(f"{here}: expected {{'vector': ..., 'scale': ...}}, got keys {sorted(entry)}")
                    scale = _number(entry.get("scale", 1.0), f"{here}.scale")
                    entry = entry["vector"]
                items.append(self._parse_item(Add(layer, entry, hook=hook, scale=scale, select=select), here))
        return items

    def _parse_item(self, item: Add | Clamp, where: str) -> Intervention:
        if item.hook not in RESIDUAL_POINTS:
            raise ValueError(f"{where}.hook: unknown hook {item.hook!r}; expected one of {list(RESIDUAL_POINTS)}")
        layer = item.layer
        if isinstance(layer, str) and layer.lstrip("-").isdigit():
            layer = int(layer)
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{where}.layer: {item.layer!r} is not a layer index in [0, {self.num_layers})")
        select = None
        if item.select is not None:
            try:
                select = SelectSpec.parse(item.select)
            except ValueError as err:
                raise ValueError(f"{where}.{err}") from None  # the message starts with "select"
        if isinstance(item, Add):
            vector = self._vector(item.vector, f"{where}.vector") * _number(item.scale, f"{where}.scale")
            return Intervention("add", item.hook, layer, vector, select)
        direction = self._vector(item.direction, f"{where}.direction")
        norm = float(direction.norm())
        if norm == 0.0:
            raise ValueError(f"{where}.direction: must not be the zero vector")
        lo = -math.inf if item.min is None else _number(item.min, f"{where}.min")
        hi = math.inf if item.max is None else _number(item.max, f"{where}.max")
        if lo > hi:
            raise ValueError(f"{where}.min: {lo} is greater than max {hi}")
        strength = _number(item.strength, f"{where}.strength")
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"{where}.strength: {strength} is outside [0, 1]")
        return Intervention("clamp", item.hook, layer, direction / norm, select, lo, hi, strength)

    def _vector(self, value: Any, where: str) -> torch.Tensor:
        try:
            if isinstance(value, torch.Tensor):
                tensor = value.detach().to("cpu", torch.float32)
            else:
                tensor = torch.as_tensor(np.asarray(value, dtype=np.float32))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: not a numeric vector ({err})") from None
        if tensor.dim() != 1 or tensor.numel() != self.hidden_size:
            raise ValueError(f"{where}: expected {self.hidden_size} values (the hidden size), "
                             f"got shape {tuple(tensor.shape)}")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{where}: contains NaN or Inf")
        return tensor.contiguous()


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value)
