"""What users write to steer (``Add``, ``Clamp``, ``SteeringSpec`` and the dict shorthands), and its
validated, canonical form (``Intervention``) that the engine composes, hashes and loads into tables."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.checks import finite_number, float32_array, is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import MLP_OUT, POST_MLP, check_hook_point
from steerable.sae.features import Feature, FeatureClamp
from steerable.sae.registry import SaeRegistry
from steerable.sae.transcoder import Transcoder
from steerable.selection import SelectSpec
from steerable.steering.items import EDIT_ITEMS, When

PREFILL = SelectSpec(prompt="all")
DECODE = SelectSpec(generation="all")


@dataclass
class Seen:
    """What one parse has checked already, so a vector or a selection given for many layers costs
    once: vectors by the memory they view (``SpecParser._vector``), the unit direction of each
    checked one, and selections by value (equal ones become one object, so what is kept per
    selection -- a config's bits, cache keys, resolutions per prompt length -- is computed once)."""

    vectors: dict[tuple, tuple[Any, torch.Tensor, bytes]] = field(default_factory=dict)  # (given, copy, hash)
    units: dict[int, tuple[torch.Tensor, bytes]] = field(default_factory=dict)  # id of a copy -> (unit, hash)
    selects: dict[SelectSpec, SelectSpec] = field(default_factory=dict)
    # id of a given selection (alive while the spec is parsed) -> the id of its equal in ``selects``
    select_ids: dict[int, int] = field(default_factory=dict)
    # Add/Clamp fields but the layer, by the identity of each (an item built per layer shares them;
    # a SelectSpec by its equal in ``selects``) -> (the item, which keeps those ids taken, and its
    # checked intervention).
    items: dict[tuple, tuple[Any, "Intervention"]] = field(default_factory=dict)


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
    """Move the projection of ``h`` on the unit ``direction`` to ``clip(factor * p, min, max)``:
    ``p = h·d; h += strength * (clip(factor * p, min, max) - p) * d``. ``min=max=0`` ablates the
    direction; ``max=c`` alone caps the projection at ``c`` (Neuronpedia's ``PROJECTION_CAP``);
    ``factor=c`` alone scales it by ``c``, ``h + (c - 1) p d`` (Neuronpedia's ``ORTHOGONAL_DECOMP``)."""

    layer: int
    direction: Any
    hook: str = POST_MLP
    min: float | None = None
    max: float | None = None
    strength: float = 1.0
    select: Any = None
    factor: float = 1.0


ITEM_TYPES = (Add, Clamp, Feature, FeatureClamp, *EDIT_ITEMS)


@dataclass
class SteeringSpec:
    """A list of interventions plus the tiered shorthands: ``vectors`` (every token),
    ``prefill_vectors`` (prompt rows), ``decode_vectors`` (generated rows), ``clamps``, and
    ``features`` (``Feature`` / ``FeatureClamp`` of registered SAEs); ``scale`` multiplies every
    additive vector and every clamp strength."""

    # Add, Clamp, Feature, FeatureClamp, LowRank, Affine, When, RouterBias
    interventions: list[Any] = field(default_factory=list)
    vectors: Any = None
    prefill_vectors: Any = None
    decode_vectors: Any = None
    clamps: list[Clamp] | None = None
    scale: float = 1.0
    features: list[Feature | FeatureClamp] | None = None

    def to_dict(self, encoding: str = "list") -> dict[str, Any]:
        """JSON-ready form (what a server takes as ``steering_vectors``); vectors as float lists or,
        with ``encoding="base64"``, as ``{"dtype", "shape", "data"}``."""
        from steerable.steering.wire import spec_to_dict  # wire builds on this module

        return spec_to_dict(self, encoding)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SteeringSpec":
        """Inverse of ``to_dict``; unknown keys raise ``InvalidRequestError`` naming the key."""
        from steerable.steering.wire import spec_from_dict

        return spec_from_dict(data)


@dataclass(frozen=True)
class Intervention:
    """Canonical, validated form: float32 CPU vectors, scale folded in, selection parsed.

    A clamp reads ``p = h·vector + bias``, gated to ``a = p if p > threshold else 0``, and writes
    ``h += strength * (clip(factor * a, lo, hi) - a) * write``. A projection clamp has ``write =
    None`` (it writes along ``vector``), bias 0 and threshold -inf (``a = p``); a feature clamp reads the
    encoder column and writes the decoder row. A transcoder feature clamp (``"tclamp"``) reads the
    same way at its site (the transcoder's input at its source layer) and writes ``write[t]`` [span,
    H] at ``mlp_out`` of layer ``layer + t``: the read and the writes are at different points."""

    kind: str  # "add" | "clamp" | "tclamp" | "lowrank" | "dense" | "router" (EDIT_KINDS)
    point: str
    layer: int
    vector: torch.Tensor  # add: the vector to add; clamp: the direction read (a projection clamp's unit direction)
    vector_hash: bytes  # _vector_hash(vector), computed once per vector rather than per layer it is given for
    select: SelectSpec | None
    lo: float = -math.inf
    hi: float = math.inf
    strength: float = 1.0
    write: torch.Tensor | None = None  # clamp: the direction written, when it is not ``vector``
    bias: float = 0.0
    threshold: float = -math.inf
    feature: tuple[str, int] | None = None  # (registered SAE, index) of a feature item; its content is in vector_hash
    # "lowrank": (V [r, H], b [r], U [r, H]) for ``h += U^T (V h + b) + vector``; "dense": (A [H, H],) for
    # ``h += A h + vector``; "router": none (``vector`` holds the bias of each expert). Their content is in vector_hash.
    matrices: tuple[torch.Tensor, ...] = ()
    gate: Any = None  # the ``steering.edits.Gate`` of an item inside a ``When``; its digest is in ours
    factor: float = 1.0  # clamp: the read value is scaled by it before clipping
    # What the content hash covers but the layer: the same at every layer an item is given for.
    unlayered: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        select = self.select.key if self.select is not None else "*"
        factor = "" if self.factor == 1.0 else f"factor={self.factor}|"  # 1 keeps every older clamp's identity
        head = f"{self.kind}|{self.point}|{self.lo}|{self.hi}|{self.strength}|{factor}{select}|".encode()
        gate = b"" if self.gate is None else b"|gate:" + self.gate.digest
        object.__setattr__(self, "unlayered", head + self.vector_hash + gate)

    @functools.cached_property
    def digest(self) -> bytes:
        """The content hash, computed once per intervention (a global spec is shared by every
        request) and when admission composes a config, not when a spec is checked: ``generate``
        checks its prompts up front and admits them while the device runs."""
        return _layer_digest(self.unlayered, self.layer)

    def at_layer(self, layer: int) -> "Intervention":
        """The same intervention at ``layer``, sharing its vector. A copy of the fields rather than
        the dataclass init: a spec gives most items once per layer, and the init costs microseconds."""
        moved = object.__new__(Intervention)
        moved.__dict__.update(self.__dict__, layer=layer)
        moved.__dict__.pop("digest", None)
        return moved

    @property
    def site(self) -> tuple[str, int]:
        return self.point, self.layer

    @property
    def sae(self) -> str | None:
        """The registered SAE a feature item uses."""
        return None if self.feature is None else self.feature[0]

    def scaled(self, scale: float, where: str) -> "Intervention":
        if self.kind == "add":
            vector = self.vector * scale
            return dataclasses.replace(self, vector=vector, vector_hash=_vector_hash(vector))
        if self.kind in EDIT_KINDS:
            from steerable.steering.edits import scaled_edit  # edits builds on this module

            return scaled_edit(self, scale)
        strength = self.strength * scale
        if not 0.0 <= strength <= 1.0:
            raise InvalidRequestError(f"{where}: clamp strength {self.strength} x scale {scale} is outside [0, 1]")
        return dataclasses.replace(self, strength=strength)

    def is_noop(self) -> bool:
        if self.kind == "add" or self.kind in EDIT_KINDS:
            return self.vector_hash == _ZERO_HASH
        return self.strength == 0.0


def _strength(value: Any, where: str) -> float:
    strength = finite_number(value, f"{where}.strength")
    if not 0.0 <= strength <= 1.0:
        raise InvalidRequestError(f"{where}.strength: {strength} is outside [0, 1]")
    return strength


EDIT_KINDS = ("lowrank", "dense", "router")  # steering.edits


def config_identity(interventions: Sequence[Intervention]) -> bytes:
    """Order-independent hash of a composed config: equal configs share rows and cache blocks."""
    return _hash(b"".join(sorted([item.digest for item in interventions])))


def _hash(data: bytes | np.ndarray) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _layer_digest(unlayered: bytes, layer: int) -> bytes:
    return hashlib.blake2b(unlayered + layer.to_bytes(4, "little"), digest_size=16).digest()


_ZERO_HASH = bytes(16)


def _vector_hash(vector: torch.Tensor) -> bytes:
    """Hash of the values; every all-zero vector gets ``_ZERO_HASH``, so ``is_noop`` needs no pass over them."""
    values = vector.numpy()
    return _hash(values) if values.any() else _ZERO_HASH


def _item_key(item: Add | Clamp, seen: Seen) -> tuple:
    """An item's fields but the layer, by the identity of each (a spec built per layer shares
    them); a SelectSpec by value (equal ones are one selection anyway, and one is often built per
    layer), looked up by identity first: hashing one by value costs microseconds."""
    select = seen.select_ids.get(id(item.select))
    if select is None:
        given = item.select
        select = seen.select_ids[id(given)] = id(seen.selects.setdefault(given, given)) \
            if isinstance(given, SelectSpec) else id(given)
    if isinstance(item, Add):
        return Add, id(item.hook), id(item.vector), id(item.scale), select
    return (Clamp, id(item.hook), id(item.direction), id(item.min), id(item.max), id(item.strength), select,
            id(item.factor))


class SpecParser:
    """Validates user specs against one model (hidden size, layer count) and normalises them."""

    def __init__(self, hidden_size: int, num_layers: int, saes: SaeRegistry | None = None,
                 router_experts: Mapping[int, int] | None = None):
        """``router_experts``: each MoE layer's number of experts (``RouterBias`` is checked against it)."""
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.saes = saes
        self.router_experts = dict(router_experts or {})

    def parse(self, spec: Any, where: str) -> list[Intervention]:
        """Any accepted form -> interventions; ``ValueError`` names ``where`` and the bad part."""
        if spec is None:
            return []
        if callable(getattr(spec, "to_spec", None)):  # a steerable.vectors.ControlVector (duck-typed: no import)
            spec = spec.to_spec()
        if isinstance(spec, ITEM_TYPES):
            spec = [spec]
        seen = Seen()
        if isinstance(spec, SteeringSpec):
            return self._parse_spec(spec, where, seen)
        if isinstance(spec, Mapping):
            return self._parse_vectors(spec, None, where, seen)
        if isinstance(spec, (list, tuple)) and all(isinstance(i, ITEM_TYPES) for i in spec):
            return self._parse_items(spec, where, seen)
        raise InvalidRequestError(f"{where}: expected a SteeringSpec, a ControlVector, Add/Clamp/Feature/FeatureClamp/"
                                  f"LowRank/Affine/When/RouterBias items or a dict of vectors, got "
                                  f"{type(spec).__name__}")

    def _parse_spec(self, spec: SteeringSpec, where: str, seen: Seen) -> list[Intervention]:
        scale = finite_number(spec.scale, f"{where}.scale")
        items = self._parse_items(spec.interventions, f"{where}.interventions", seen)
        items += self._parse_vectors(spec.vectors, None, f"{where}.vectors", seen)
        items += self._parse_vectors(spec.prefill_vectors, PREFILL, f"{where}.prefill_vectors", seen)
        items += self._parse_vectors(spec.decode_vectors, DECODE, f"{where}.decode_vectors", seen)
        for i, clamp in enumerate(spec.clamps or []):
            if not isinstance(clamp, Clamp):
                raise InvalidRequestError(f"{where}.clamps[{i}]: expected a Clamp, got {type(clamp).__name__}")
            items.append(self._parse_item(clamp, f"{where}.clamps[{i}]", seen))
        for i, feature in enumerate(spec.features or []):
            if not isinstance(feature, (Feature, FeatureClamp)):
                raise InvalidRequestError(f"{where}.features[{i}]: expected a Feature or FeatureClamp, got "
                                          f"{type(feature).__name__}")
            items += self._feature(feature, f"{where}.features[{i}]", seen)
        return [item.scaled(scale, f"{where}.scale") for item in items] if scale != 1.0 else items

    def _parse_vectors(self, vectors: Any, select: SelectSpec | None, where: str, seen: Seen) -> list[Intervention]:
        """``{layer: v}`` (post_mlp) or ``{hook: {layer: v | {"vector": v, "scale": s}}}``."""
        if vectors is None:
            return []
        if not isinstance(vectors, Mapping):
            raise InvalidRequestError(f"{where}: expected a dict of vectors, got {type(vectors).__name__}")
        if vectors and all(isinstance(k, str) and not k.lstrip("-").isdigit() for k in vectors):
            by_hook = vectors
        else:
            by_hook = {POST_MLP: vectors}
        items = []
        for hook, layers in by_hook.items():
            if not isinstance(layers, Mapping):
                raise InvalidRequestError(f"{where}.{hook}: expected {{layer: vector}}, got {type(layers).__name__}")
            for layer, entry in layers.items():
                here = f"{where}.{hook}[{layer}]"
                scale = 1.0
                if isinstance(entry, Mapping):
                    unknown = set(entry) - {"vector", "scale"}
                    if unknown or "vector" not in entry:
                        raise InvalidRequestError(f"{here}: expected {{'vector': ..., 'scale': ...}}, got keys {sorted(entry)}")
                    scale = finite_number(entry.get("scale", 1.0), f"{here}.scale")
                    entry = entry["vector"]
                item = self._add(hook, layer, entry, select, here, seen)
                items.append(item.scaled(scale, here) if scale != 1.0 else item)
        return items

    def _parse_items(self, given: Sequence[Any], where: str, seen: Seen) -> list[Intervention]:
        """Each item, those repeated at another layer taken the short way (``where`` is formatted
        only for the others: a spec gives most items once per layer, and admission parses them all)."""
        items = []
        for i, item in enumerate(given):
            repeated = self._repeated(item, seen)
            if repeated is not None:
                items.append(repeated)
            elif isinstance(item, When):  # one intervention per gated item
                from steerable.steering.edits import parse_when

                items += parse_when(self, item, f"{where}[{i}]", seen)
            else:
                items += self._parse_one(item, f"{where}[{i}]", seen)
        return items

    def _parse_one(self, item: Any, where: str, seen: Seen) -> list[Intervention]:
        """One item but a ``When`` as its interventions (a transcoder's feature add is one per layer
        it decodes to)."""
        if isinstance(item, (Feature, FeatureClamp)):
            return self._feature(item, where, seen)
        if isinstance(item, EDIT_ITEMS):
            from steerable.steering.edits import parse_edit  # edits builds on this module

            return [parse_edit(self, item, where, seen)]
        if not isinstance(item, (Add, Clamp)):
            raise InvalidRequestError(f"{where}: expected an intervention item, got {type(item).__name__}")
        return [self._parse_item(item, where, seen)]

    def _parse_item(self, item: Add | Clamp, where: str, seen: Seen) -> Intervention:
        key = _item_key(item, seen)
        known = seen.items.get(key)
        if known is None:
            check_hook_point(item.hook, f"{where}.hook")  # before the layer, as for any other item
            layer = self._layer(item.layer, where)
            known = seen.items[key] = item, self._check_item(item, layer, where, seen)
            return known[1]
        return known[1].at_layer(self._layer(item.layer, where))

    def _repeated(self, item: Any, seen: Seen) -> Intervention | None:
        """An ``Add`` or ``Clamp`` whose fields but a valid layer were checked already, moved to its
        layer; None for anything else (``_parse_item`` checks it, with the place named for errors)."""
        if type(item) is not Add and type(item) is not Clamp:
            return None
        known = seen.items.get(_item_key(item, seen))
        layer = item.layer
        if known is None or type(layer) is not int or not 0 <= layer < self.num_layers:
            return None
        return known[1].at_layer(layer)

    def _check_item(self, item: Add | Clamp, layer: int, where: str, seen: Seen) -> Intervention:
        """An ``Add`` or ``Clamp`` at ``layer``, checked (the other layers' come from it)."""
        if isinstance(item, Add):
            add = self._add(item.hook, layer, item.vector, item.select, where, seen)
            scale = finite_number(item.scale, f"{where}.scale")
            return add.scaled(scale, where) if scale != 1.0 else add
        select = self._select(item.hook, item.select, where, seen)
        direction, _ = self._vector(item.direction, f"{where}.direction", seen)
        unit = seen.units.get(id(direction))  # the copy lives as long as the parse: its id is its own
        if unit is None:
            norm = float(direction.norm())
            if norm == 0.0:
                raise InvalidRequestError(f"{where}.direction: must not be the zero vector")
            unit_direction = direction / norm
            unit = seen.units[id(direction)] = unit_direction, _vector_hash(unit_direction)
        lo = -math.inf if item.min is None else finite_number(item.min, f"{where}.min")
        hi = math.inf if item.max is None else finite_number(item.max, f"{where}.max")
        if lo > hi:
            raise InvalidRequestError(f"{where}.min: {lo} is greater than max {hi}")
        strength = _strength(item.strength, where)
        factor = finite_number(item.factor, f"{where}.factor")
        return Intervention("clamp", item.hook, layer, *unit, select, lo, hi, strength, factor=factor)

    def _feature(self, item: Feature | FeatureClamp, where: str, seen: Seen) -> list[Intervention]:
        """A feature item resolved against the registry: its SAE's point, decoder row and (for a
        clamp) how the SAE reads the feature. Its identity is the SAE's content hash and the index
        (plus scale, or value and strength), never the name the SAE is registered under."""
        if self.saes is None:
            raise InvalidRequestError(f"{where}.sae: feature steering needs an engine with registered SAEs")
        sae = self.saes.get(item.sae, f"{where}.sae")
        if not is_int(item.index) or not 0 <= item.index < sae.d_sae:
            raise InvalidRequestError(f"{where}.index: {item.index!r} is not a feature index in [0, {sae.d_sae})")
        if isinstance(sae, Transcoder):
            return self._transcoder_feature(item, sae, where, seen)
        layer, select = self._site(sae.hook, sae.layer, item.select, where, seen)
        index = item.index
        head = sae.content_hash + f"|{index}|".encode()
        if isinstance(item, Feature):
            scale = finite_number(item.scale, f"{where}.scale")
            vector = sae.decoder_row(index) * scale
            vector_hash = _hash(b"feature-add|" + head + repr(scale).encode()) if vector.any() else _ZERO_HASH
            return [Intervention("add", sae.hook, layer, vector, vector_hash, select, feature=(item.sae, index))]
        value = finite_number(item.value, f"{where}.value")
        strength = _strength(item.strength, where)
        read, bias, threshold = sae.feature_read(index)
        return [Intervention("clamp", sae.hook, layer, read, _hash(b"feature-clamp|" + head), select, value, value,
                             strength, write=sae.decoder_row(index), bias=bias, threshold=threshold,
                             feature=(item.sae, index))]

    def _transcoder_feature(self, item: Feature | FeatureClamp, transcoder: Transcoder, where: str,
                            seen: Seen) -> list[Intervention]:
        """A transcoder's feature: an add of its (scaled) decoder row at ``mlp_out`` of each layer it
        decodes to; a clamp reads it where the transcoder reads (its source layer) and writes along
        those rows (``"tclamp"``)."""
        select = self._select(MLP_OUT, item.select, where, seen)
        index = item.index
        head = transcoder.content_hash + f"|{index}|".encode()
        rows = transcoder.decoder_rows(index)
        if isinstance(item, Feature):
            scale = finite_number(item.scale, f"{where}.scale")
            vector_hash = _hash(b"feature-add|" + head + repr(scale).encode())
            return [Intervention("add", MLP_OUT, layer, row * scale, vector_hash, select, feature=(item.sae, index))
                    for layer, row in rows if scale != 0.0 and row.any()]
        if transcoder.decodes_across(self.saes.pipeline_stages):
            raise InvalidRequestError(f"{where}.sae: {item.sae!r} decodes from one pipeline stage's layers into "
                                      "another's; its feature clamps need every layer it spans on one stage")
        value = finite_number(item.value, f"{where}.value")
        strength = _strength(item.strength, where)
        read, bias, threshold = transcoder.feature_read(index)
        source, _ = transcoder.locate(index)
        return [Intervention("tclamp", transcoder.hook, source, read, _hash(b"feature-clamp|" + head), select, value,
                             value, strength, write=torch.stack([row for _, row in rows]), bias=bias,
                             threshold=threshold, feature=(item.sae, index))]

    def _add(self, hook: str, layer: Any, vector: Any, select: Any, where: str, seen: Seen) -> Intervention:
        """The unscaled ``Add``: the dict shorthand comes here directly, without building one."""
        layer, select = self._site(hook, layer, select, where, seen)
        vector, vector_hash = self._vector(vector, f"{where}.vector", seen)
        return Intervention("add", hook, layer, vector, vector_hash, select)

    def _site(self, hook: str, layer: Any, select: Any, where: str, seen: Seen) -> tuple[int, SelectSpec | None]:
        """Checks the hook and the layer (a digit string is accepted) and parses the selection."""
        select = self._select(hook, select, where, seen)
        return self._layer(layer, where), select

    def _select(self, hook: str, select: Any, where: str, seen: Seen) -> SelectSpec | None:
        """Checks the hook and parses the selection (equal ones become one object)."""
        check_hook_point(hook, f"{where}.hook")
        if select is None:
            return None
        try:
            select = SelectSpec.parse(select)
        except ValueError as err:
            raise InvalidRequestError(f"{where}.{err}") from None  # the message starts with "select"
        return seen.selects.setdefault(select, select)

    def _layer(self, layer: Any, where: str) -> int:
        """A layer index (a digit string is accepted)."""
        index = int(layer) if isinstance(layer, str) and layer.lstrip("-").isdigit() else layer
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.num_layers:
            raise InvalidRequestError(f"{where}.layer: {layer!r} is not a layer index in [0, {self.num_layers})")
        return index

    def _vector(self, value: Any, where: str, seen: Seen) -> tuple[torch.Tensor, bytes]:
        """A float32 CPU copy (later in-place changes by the caller never reach an admitted config)
        and its hash, checked with numpy (a small torch op costs microseconds). A vector given for
        many layers is checked, copied and hashed once per parse: ``seen`` knows a tensor by the
        memory it views (``t[i]`` is a new object at each layer) and anything else by identity, and
        holds the given value, so no other object can take over its id or memory meanwhile. The
        same object given again is found by identity first (a tensor's key costs microseconds)."""
        by_id = (id(value),)
        if by_id in seen.vectors:
            return seen.vectors[by_id][1:]
        key = by_id
        if isinstance(value, torch.Tensor) and value.layout == torch.strided:
            key = value.data_ptr(), value.dtype, value.device, value.shape, value.stride(), value.is_neg()
            if key in seen.vectors:
                seen.vectors[by_id] = value, *seen.vectors[key][1:]
                return seen.vectors[key][1:]
        array = float32_array(value, where)
        if array.ndim != 1 or array.size != self.hidden_size:
            raise InvalidRequestError(f"{where}: expected {self.hidden_size} values (the hidden size), "
                             f"got shape {array.shape}")
        if not np.isfinite(array).all():
            raise InvalidRequestError(f"{where}: contains NaN or Inf")
        tensor = torch.from_numpy(array.copy())
        vector_hash = _vector_hash(tensor)
        seen.vectors[key] = seen.vectors[by_id] = value, tensor, vector_hash
        return tensor, vector_hash

