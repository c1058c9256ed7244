"""``LowRank``, ``Affine``, ``When`` and ``RouterBias`` as JSON (items of a spec's
``interventions``, beside ``steering.wire``'s adds, clamps and features):

    {"type": "lowrank", "layer": 6, "R": M, "W": M, "b": v, "hook": "post_mlp", "select": ...}
    {"type": "affine", "layer": 6, "A": M, "c": v, ...}    or    {"type": "affine", "U": M, "V": M, ...}
    {"type": "when", "items": [...], "layer": 4, "direction": v | {"type": "feature", "sae", "index"},
     "threshold": 0.5, "hook": "post_mlp", "scope": "token" | "prompt", "compare": ">" | "<"}
    {"type": "router_bias", "layer": 2, "expert": 5, "bias": 4.0}

A matrix ``M`` is a list of rows or ``{"dtype", "shape": [rows, cols], "data": base64}`` (the
vector form with two dimensions); shapes are checked against the model at admission.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from steerable.errors import InvalidRequestError
from steerable.sae.features import Feature
from steerable.steering.items import Affine, LowRank, RouterBias, When

_KEYS = {
    "lowrank": {"type", "layer", "R", "W", "b", "hook", "select"},
    "affine": {"type", "layer", "A", "U", "V", "c", "hook", "select"},
    "when": {"type", "items", "layer", "direction", "threshold", "hook", "scope", "compare"},
    "router_bias": {"type", "layer", "expert", "bias"},
}


def edit_to_dict(item: Any, encoding: str, item_to_dict: Callable[[Any, str], dict]) -> dict[str, Any]:
    """``item_to_dict``: how the items inside a ``When`` are written (``wire._item_to_dict``)."""
    from steerable.steering.wire import encode_vector
    from steerable.selection import SelectSpec

    select = None if getattr(item, "select", None) is None else SelectSpec.parse(item.select).to_wire()
    if isinstance(item, LowRank):
        return {"type": "lowrank", "layer": item.layer, "R": encode_matrix(item.R, encoding),
                "W": encode_matrix(item.W, encoding), "b": None if item.b is None else encode_vector(item.b, encoding),
                "hook": item.hook, "select": select}
    if isinstance(item, Affine):
        A = {"U": encode_matrix(item.A[0], encoding), "V": encode_matrix(item.A[1], encoding)} \
            if isinstance(item.A, tuple) else {"A": encode_matrix(item.A, encoding)}
        return {"type": "affine", "layer": item.layer, **A,
                "c": None if item.c is None else encode_vector(item.c, encoding), "hook": item.hook, "select": select}
    if isinstance(item, RouterBias):
        return {"type": "router_bias", "layer": item.layer, "expert": item.expert, "bias": item.bias}
    direction = item.direction
    if isinstance(direction, Feature):
        direction = {"type": "feature", "sae": direction.sae, "index": direction.index}
    else:
        direction = encode_vector(direction, encoding)
    return {"type": "when", "items": [item_to_dict(inner, encoding) for inner in item.items], "layer": item.layer,
            "direction": direction, "threshold": item.threshold, "hook": item.hook, "scope": item.scope,
            "compare": item.compare}


def edit_from_dict(data: Mapping, where: str, item_from_dict: Callable[[Any, str], Any]) -> Any:
    """``item_from_dict``: how the items inside a ``When`` are read (``wire._item_from_dict``)."""
    from steerable.steering.wire import _optional, _reject_unknown, _require, _select, decode_vector

    kind = data["type"]
    _reject_unknown(data, _KEYS[kind], where)
    if kind == "lowrank":
        _require(data, ("layer", "R", "W"), where)
        b = None if data.get("b") is None else decode_vector(data["b"], f"{where}.b")
        return LowRank(data["layer"], decode_matrix(data["R"], f"{where}.R"), decode_matrix(data["W"], f"{where}.W"),
                       b, **_optional(data, ("hook",)), select=_select(data.get("select"), where))
    if kind == "affine":
        _require(data, ("layer",), where)
        given = [key for key in ("A", "U", "V") if data.get(key) is not None]
        if given == ["A"]:
            A = decode_matrix(data["A"], f"{where}.A")
        elif given == ["U", "V"]:
            A = (decode_matrix(data["U"], f"{where}.U"), decode_matrix(data["V"], f"{where}.V"))
        else:
            raise InvalidRequestError(f"{where}.A: give either A (a [d, d] matrix) or both U and V (low rank), "
                                      f"got {given or 'neither'}")
        c = None if data.get("c") is None else decode_vector(data["c"], f"{where}.c")
        return Affine(data["layer"], A, c, **_optional(data, ("hook",)), select=_select(data.get("select"), where))
    if kind == "router_bias":
        _require(data, ("layer", "expert", "bias"), where)
        return RouterBias(data["layer"], data["expert"], data["bias"])
    _require(data, ("items", "direction", "threshold"), where)
    items = data["items"]
    if not isinstance(items, list):
        raise InvalidRequestError(f"{where}.items: expected a list")
    direction = data["direction"]
    if isinstance(direction, Mapping) and direction.get("type") == "feature":
        _reject_unknown(direction, ("type", "sae", "index"), f"{where}.direction")
        _require(direction, ("sae", "index"), f"{where}.direction")
        direction = Feature(direction["sae"], direction["index"])
    else:
        direction = decode_vector(direction, f"{where}.direction")
    return When([item_from_dict(inner, f"{where}.items[{i}]") for i, inner in enumerate(items)], data.get("layer"),
                direction, data["threshold"], **_optional(data, ("hook", "scope", "compare")))


def encode_matrix(matrix: Any, encoding: str = "list") -> list[list[float]] | dict[str, Any]:
    """A matrix (nested lists, numpy array or tensor) as float32 JSON: rows, or the base64 form."""
    if isinstance(matrix, torch.Tensor):
        array = matrix.detach().to("cpu", torch.float32).numpy()
    else:
        array = np.asarray(matrix, dtype=np.float32)
    if encoding == "list":
        return array.tolist()
    if encoding == "base64":
        return {"dtype": "float32", "shape": list(array.shape),
                "data": base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")}
    raise InvalidRequestError(f"encoding: expected 'list' or 'base64', got {encoding!r}")


def decode_matrix(value: Any, where: str) -> np.ndarray:
    """A JSON matrix as a float32 [rows, cols] array (sizes are checked at admission)."""
    from steerable.steering.wire import decode_encoded

    if isinstance(value, Mapping):
        return decode_encoded(value, where, 2)
    if isinstance(value, list) and all(isinstance(row, list) for row in value):
        try:
            array = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"{where}: rows must be lists of numbers of one length") from None
        if array.ndim == 2 or (array.ndim == 1 and array.size == 0):
            return array.reshape(len(value), -1) if array.size else np.zeros((len(value), 0), np.float32)
    raise InvalidRequestError(f"{where}: expected a list of rows of numbers or {{'dtype', 'shape', 'data'}}, "
                              f"got {type(value).__name__}")
