"""Steering specs as JSON: what ``SteeringSpec.to_dict`` writes and ``from_dict`` reads, and the
request form a server receives (a full spec dict or the ``{layer: v}`` / ``{hook: {layer: v}}``
shorthands).

A vector is a JSON list of numbers or ``{"dtype": "float32" | "float16" | "bfloat16", "shape": [H],
"data": base64}`` with little-endian values: at width 4096 and more a float list costs
milliseconds to parse, the base64 form a copy. Unknown keys are errors naming the key, so a typo
never silently drops an intervention.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from steerable.errors import InvalidRequestError
from steerable.selection import SelectSpec
from steerable.sae.features import Feature, FeatureClamp
from steerable.steering.items import EDIT_ITEMS
from steerable.steering.spec import Add, Clamp, SteeringSpec

SPEC_KEYS = ("interventions", "vectors", "prefill_vectors", "decode_vectors", "clamps", "scale", "features")
_TIERS = ("vectors", "prefill_vectors", "decode_vectors")
_ADD_KEYS = {"type", "layer", "vector", "hook", "scale", "select"}
_CLAMP_KEYS = {"type", "layer", "direction", "hook", "min", "max", "strength", "select", "factor"}
# A feature: {"sae", "index", "scale"?} adds; {"sae", "index", "value"?, "clamp": true, "strength"?} clamps.
_FEATURE_KEYS = {"type", "sae", "index", "scale", "value", "clamp", "strength", "select"}
_EDIT_TYPES = ("lowrank", "affine", "when", "router_bias")  # steering.wire_items
_VECTOR_KEYS = {"dtype", "shape", "data"}
_WIRE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}


# ---------------------------------------------------------------- vectors

def encode_vector(vector: Any, encoding: str = "list") -> list[float] | dict[str, Any]:
    """A vector (list, numpy array or tensor) as float32 JSON: a list, or the base64 form."""
    array = _float32(vector)
    if encoding == "list":
        return array.tolist()
    if encoding == "base64":
        return {"dtype": "float32", "shape": [int(array.size)],
                "data": base64.b64encode(array.astype("<f4").tobytes()).decode("ascii")}
    raise InvalidRequestError(f"encoding: expected 'list' or 'base64', got {encoding!r}")


def decode_vector(value: Any, where: str) -> np.ndarray:
    """A JSON vector as a float32 array; the hidden size is checked later, at admission."""
    if isinstance(value, Mapping):
        return decode_encoded(value, where, 1)
    if isinstance(value, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        return np.asarray(value, dtype=np.float32)
    raise InvalidRequestError(f"{where}: expected a list of numbers or {{'dtype', 'shape', 'data'}}, "
                              f"got {type(value).__name__}")


def decode_encoded(value: Mapping, where: str, rank: int) -> np.ndarray:
    """The base64 form ``{"dtype", "shape", "data"}`` of a vector (``rank`` 1, shape ``[H]`` with
    H > 0) or a matrix (``rank`` 2, ``[rows, cols]``) as a float32 array of that shape."""
    unknown = sorted(set(value) - _VECTOR_KEYS)
    if unknown or not _VECTOR_KEYS <= set(value):
        kind = "vector" if rank == 1 else "matrix"
        raise InvalidRequestError(f"{where}: an encoded {kind} has exactly the keys {sorted(_VECTOR_KEYS)}, "
                                  f"got {sorted(value)}")
    raw = _WIRE_DTYPES.get(value["dtype"])
    if raw is None:
        raise InvalidRequestError(f"{where}.dtype: expected one of {list(_WIRE_DTYPES)}, got {value['dtype']!r}")
    shape = value["shape"]
    if not (isinstance(shape, list) and len(shape) == rank and all(isinstance(n, int) and not isinstance(n, bool)
                                                                   and n >= (rank == 1) for n in shape)):
        raise InvalidRequestError(f"{where}.shape: expected {'[H] with H > 0' if rank == 1 else '[rows, cols]'}, "
                                  f"got {shape!r}")
    if not isinstance(value["data"], str):
        raise InvalidRequestError(f"{where}.data: expected a base64 string")
    try:
        data = base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}.data: not valid base64") from None
    count = math.prod(shape)
    if len(data) != count * raw.itemsize:
        raise InvalidRequestError(f"{where}.data: {len(data)} bytes do not hold {' x '.join(map(str, shape))} "
                                  f"{value['dtype']} values")
    array = np.frombuffer(data, dtype=raw)
    if value["dtype"] == "bfloat16":  # the high half of a float32
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32).reshape(shape)


def _float32(vector: Any) -> np.ndarray:
    if isinstance(vector, torch.Tensor):
        return vector.detach().to("cpu", torch.float32).numpy().reshape(-1)
    return np.asarray(vector, dtype=np.float32).reshape(-1)


# ---------------------------------------------------------------- SteeringSpec <-> dict

def spec_to_dict(spec: SteeringSpec, encoding: str = "list") -> dict[str, Any]:
    """JSON-ready dict of every field that is set (layer keys as strings, selections in wire form)."""
    out: dict[str, Any] = {}
    if spec.interventions:
        out["interventions"] = [_item_to_dict(item, encoding) for item in spec.interventions]
    for tier in _TIERS:
        vectors = getattr(spec, tier)
        if vectors is not None:
            out[tier] = _vectors_to_dict(vectors, encoding)
    if spec.clamps is not None:
        out["clamps"] = [_item_to_dict(clamp, encoding) for clamp in spec.clamps]
    if spec.features is not None:
        out["features"] = [_feature_to_dict(item) for item in spec.features]
    if spec.scale != 1.0:
        out["scale"] = spec.scale
    return out


def spec_from_dict(data: Any, where: str = "steering") -> SteeringSpec:
    """Inverse of ``spec_to_dict``; also reads base64 vectors and selection shortcuts."""
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(data).__name__}")
    _reject_unknown(data, SPEC_KEYS, where)
    items = data.get("interventions") or []
    if not isinstance(items, list):
        raise InvalidRequestError(f"{where}.interventions: expected a list")
    clamps = data.get("clamps")
    if clamps is not None and not isinstance(clamps, list):
        raise InvalidRequestError(f"{where}.clamps: expected a list")
    features = data.get("features")
    if features is not None and not isinstance(features, list):
        raise InvalidRequestError(f"{where}.features: expected a list")
    return SteeringSpec(
        interventions=[_item_from_dict(item, f"{where}.interventions[{i}]") for i, item in enumerate(items)],
        **{tier: vectors_from_json(data[tier], f"{where}.{tier}") for tier in _TIERS if data.get(tier) is not None},
        clamps=None if clamps is None else [_clamp_from_dict(c, f"{where}.clamps[{i}]") for i, c in enumerate(clamps)],
        scale=data.get("scale", 1.0),
        features=None if features is None else [_feature_from_dict(f, f"{where}.features[{i}]")
                                                for i, f in enumerate(features)],
    )


def steering_from_json(value: Any, where: str = "steering_vectors") -> Any:
    """A request's steering in JSON: a full spec dict (any key of ``SPEC_KEYS``) or a shorthand
    dict of vectors. Returns what ``SamplingParams(steering_vectors=...)`` takes."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(value).__name__}")
    if any(key in SPEC_KEYS for key in value):
        return spec_from_dict(value, where)
    return vectors_from_json(value, where)


def vectors_from_json(value: Any, where: str) -> dict:
    """``{layer: v}`` or ``{hook: {layer: v | {"vector": v, "scale": s}}}`` with vectors decoded;
    the keys are left for the spec parser, which names a bad layer or hook."""
    if not isinstance(value, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict of vectors, got {type(value).__name__}")
    if value and all(isinstance(k, str) and not k.lstrip("-").isdigit() for k in value):
        return {hook: _layers_from_json(layers, f"{where}.{hook}") for hook, layers in value.items()}
    return _layers_from_json(value, where)


def _layers_from_json(layers: Any, where: str) -> dict:
    if not isinstance(layers, Mapping):
        # Reached under a key that is not a layer number: a hook name, or a layer misspelt.
        raise InvalidRequestError(f"{where}: expected {{layer: vector}} under a hook name, got "
                                  f"{type(layers).__name__}; layer keys are integers (\"12\": [...]), other keys "
                                  "name hooks (\"post_mlp\": {\"12\": [...]})")
    out = {}
    for layer, entry in layers.items():
        here = f"{where}[{layer}]"
        if isinstance(entry, Mapping) and "vector" in entry:
            _reject_unknown(entry, ("vector", "scale"), here)
            out[layer] = {**entry, "vector": decode_vector(entry["vector"], f"{here}.vector")}
        else:
            out[layer] = decode_vector(entry, f"{here}.vector")
    return out


def _vectors_to_dict(vectors: Mapping, encoding: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, entry in vectors.items():
        if isinstance(entry, Mapping) and "vector" not in entry:  # a hook's {layer: ...}
            out[str(key)] = _vectors_to_dict(entry, encoding)
        elif isinstance(entry, Mapping):
            out[str(key)] = {**entry, "vector": encode_vector(entry["vector"], encoding)}
        else:
            out[str(key)] = encode_vector(entry, encoding)
    return out


def _feature_to_dict(item: Feature | FeatureClamp) -> dict[str, Any]:
    select = None if item.select is None else SelectSpec.parse(item.select).to_wire()
    if isinstance(item, Feature):
        return {"sae": item.sae, "index": item.index, "scale": item.scale, "select": select}
    if isinstance(item, FeatureClamp):
        return {"sae": item.sae, "index": item.index, "value": item.value, "clamp": True, "strength": item.strength,
                "select": select}
    raise InvalidRequestError(f"features: expected Feature or FeatureClamp, got {type(item).__name__}")


def _feature_from_dict(data: Any, where: str) -> Feature | FeatureClamp:
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(data).__name__}")
    if data.get("type", "feature") != "feature":
        raise InvalidRequestError(f"{where}.type: expected 'feature', got {data['type']!r}")
    _reject_unknown(data, _FEATURE_KEYS, where)
    _require(data, ("sae", "index"), where)
    clamp = data.get("clamp", False)
    if not isinstance(clamp, bool):
        raise InvalidRequestError(f"{where}.clamp: expected true or false, got {clamp!r}")
    wrong = ("scale",) if clamp else ("value", "strength")
    given = [key for key in wrong if data.get(key) is not None]
    if given:
        kind = "a clamp (\"clamp\": true)" if clamp else "an add (no \"clamp\": true)"
        raise InvalidRequestError(f"{where}.{given[0]}: {kind} takes no {given[0]!r}")
    select = _select(data.get("select"), where)
    if clamp:
        return FeatureClamp(data["sae"], data["index"], **_optional(data, ("value",)), select=select,
                            **_optional(data, ("strength",)))
    return Feature(data["sae"], data["index"], **_optional(data, ("scale",)), select=select)


def _item_to_dict(item: Any, encoding: str) -> dict[str, Any]:
    if isinstance(item, (Feature, FeatureClamp)):
        return {"type": "feature", **_feature_to_dict(item)}
    if isinstance(item, EDIT_ITEMS):
        from steerable.steering.wire_items import edit_to_dict  # it builds on this module

        return edit_to_dict(item, encoding, _item_to_dict)
    select = None if item.select is None else SelectSpec.parse(item.select).to_wire()
    if isinstance(item, Add):
        return {"type": "add", "layer": item.layer, "vector": encode_vector(item.vector, encoding), "hook": item.hook,
                "scale": item.scale, "select": select}
    if isinstance(item, Clamp):
        out = {"type": "clamp", "layer": item.layer, "direction": encode_vector(item.direction, encoding),
               "hook": item.hook, "min": _finite_or_none(item.min), "max": _finite_or_none(item.max),
               "strength": item.strength, "select": select}
        if item.factor != 1.0:  # written only when it scales, so older readers read every other clamp
            out["factor"] = item.factor
        return out
    raise InvalidRequestError(f"interventions: expected an intervention item, got {type(item).__name__}")


def _item_from_dict(data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(data).__name__}")
    kind = data.get("type")
    if kind == "clamp":
        return _clamp_from_dict(data, where)
    if kind == "feature":
        return _feature_from_dict(data, where)
    if kind in _EDIT_TYPES:
        from steerable.steering.wire_items import edit_from_dict

        return edit_from_dict(data, where, _item_from_dict)
    if kind != "add":
        raise InvalidRequestError(f"{where}.type: expected one of {['add', 'clamp', 'feature', *_EDIT_TYPES]}, "
                                  f"got {kind!r}")
    _reject_unknown(data, _ADD_KEYS, where)
    _require(data, ("layer", "vector"), where)
    return Add(data["layer"], decode_vector(data["vector"], f"{where}.vector"), **_optional(data, ("hook", "scale")),
               select=_select(data.get("select"), where))


def _clamp_from_dict(data: Any, where: str) -> Clamp:
    if not isinstance(data, Mapping):
        raise InvalidRequestError(f"{where}: expected a dict, got {type(data).__name__}")
    if data.get("type", "clamp") != "clamp":
        raise InvalidRequestError(f"{where}.type: expected 'clamp', got {data['type']!r}")
    _reject_unknown(data, _CLAMP_KEYS, where)
    _require(data, ("layer", "direction"), where)
    return Clamp(data["layer"], decode_vector(data["direction"], f"{where}.direction"),
                 **_optional(data, ("hook", "min", "max", "strength", "factor")),
                 select=_select(data.get("select"), where))


def _select(value: Any, where: str) -> SelectSpec | None:
    if value is None:
        return None
    try:
        return SelectSpec.parse(value)
    except ValueError as err:
        raise InvalidRequestError(f"{where}.{err}") from None  # the message starts with "select"


def _optional(data: Mapping, keys: Sequence[str]) -> dict[str, Any]:
    return {key: data[key] for key in keys if data.get(key) is not None}


def _require(data: Mapping, keys: Sequence[str], where: str) -> None:
    missing = [key for key in keys if key not in data]
    if missing:
        raise InvalidRequestError(f"{where}: missing {missing}")


def _reject_unknown(data: Mapping, allowed: Sequence[str], where: str) -> None:
    unknown = sorted(str(key) for key in data if key not in allowed)
    if unknown:
        raise InvalidRequestError(f"{where}.{unknown[0]}: unknown key; expected one of {sorted(allowed)}")


def _finite_or_none(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) else value
