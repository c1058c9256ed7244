"""``LowRank``, ``Affine``, ``RouterBias`` and ``When`` checked against one model and made canonical
(``Intervention`` kinds "lowrank", "dense" and "router", and the ``Gate`` of a ``When``'s items).

Every low-rank edit is ``h += U^T (V h + b) + c`` with ``V``, ``U`` [r, H], ``b`` [r], ``c`` [H]:
LoReFT's ``h + R^T (W h + b - R h)`` is ``V = W - R``, ``U = R``, ``c = 0``; ``Affine(A=(U, V))``
is ``V``, ``U^T``, ``b = 0``. A full ``Affine`` is "dense": ``h += A h + c``. Edits at one hook point
read the same stream (after its adds and clamps) and their changes are summed, so their order does
not matter (as for the order-independent identity of a config).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from steerable.checks import finite_number, is_int
from steerable.errors import InvalidRequestError
from steerable.hook_points import (MLP_IN, MLP_OUT, POST_ATTN, POST_MLP, PRE_ATTN, ROUTER_LOGITS,
                                   check_hook_point)
from steerable.sae.features import Feature, FeatureClamp
from steerable.steering.items import Affine, LowRank, RouterBias, When
from steerable.checks import float32_array
from steerable.steering.spec import _ZERO_HASH, Add, Clamp, Intervention, Seen

if TYPE_CHECKING:
    from steerable.steering.spec import SpecParser

# Where each point lies in a layer, in forward order: a gate may only gate items at or after it.
POINT_ORDER = {PRE_ATTN: 0, POST_ATTN: 1, MLP_IN: 2, ROUTER_LOGITS: 3, MLP_OUT: 4, POST_MLP: 5}
# Deviation of R R^T from the identity accepted for "orthonormal rows" (float32 round-off of a
# trained rotation is about 1e-6; a rotation stored in bfloat16 is not orthonormal to 1e-3).
ORTHONORMAL_TOL = 1e-3
SCOPES = ("token", "prompt")
COMPARES = (">", "<")


def site_order(point: str, layer: int) -> tuple[int, int]:
    """The forward order of a hook point: layers first, then the points inside a layer."""
    return layer, POINT_ORDER[point]


@dataclass(frozen=True)
class Gate:
    """A ``When``'s condition, canonical: ``p = h·read + bias`` at ``(point, layer)``, taken as
    ``a = p if p > floor else 0`` (a feature's activation; a projection has ``floor = -inf``), and
    passing where ``a > threshold`` (``compare=">"``) or ``a < threshold``; per row
    (``scope="token"``) or by its mean over the prompt rows (``"prompt"``)."""

    point: str
    layer: int
    read: torch.Tensor  # float32 [H]: the unit direction, or the feature's encoder column
    bias: float
    floor: float
    threshold: float
    compare: str
    scope: str
    feature: tuple[str, int] | None = None  # (registered SAE, index) of a feature gate
    digest: bytes = field(default=b"", compare=False)

    @property
    def site(self) -> tuple[str, int]:
        return self.point, self.layer

    @property
    def sign(self) -> float:
        return 1.0 if self.compare == ">" else -1.0


def edit_hash(kind: str, vector: torch.Tensor, matrices: Sequence[torch.Tensor]) -> bytes:
    """Hash of an edit's tensors; ``_ZERO_HASH`` when it writes nothing (``Intervention.is_noop``):
    no constant and a zero U (low-rank) or A (dense)."""
    written = [vector] + ([matrices[2]] if kind == "lowrank" else list(matrices[:1]))
    if not any(t.numpy().any() for t in written):
        return _ZERO_HASH
    digest = hashlib.blake2b(kind.encode(), digest_size=16)
    for tensor in (vector, *matrices):
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.digest()


def scaled_edit(item: Intervention, scale: float) -> Intervention:
    """What the edit writes, scaled: the constant and ``U`` (low-rank), ``A`` (dense) or the router bias."""
    vector, matrices = item.vector * scale, item.matrices
    if item.kind == "lowrank":
        matrices = (*matrices[:2], matrices[2] * scale)
    elif item.kind == "dense":
        matrices = (matrices[0] * scale,)
    return replace(item, vector=vector, matrices=matrices, vector_hash=edit_hash(item.kind, vector, matrices))


def parse_edit(parser: SpecParser, item: Any, where: str, seen: Seen) -> Intervention:
    if isinstance(item, LowRank):
        return _lowrank(parser, item, where, seen)
    if isinstance(item, Affine):
        return _affine(parser, item, where, seen)
    if isinstance(item, RouterBias):
        return _router_bias(parser, item, where)
    raise InvalidRequestError(f"{where}: a When cannot hold another When")


def parse_when(parser: SpecParser, item: When, where: str, seen: Seen) -> list[Intervention]:
    """The gated items, each carrying the gate (which is part of their identity)."""
    if item.scope not in SCOPES:
        raise InvalidRequestError(f"{where}.scope: expected one of {list(SCOPES)}, got {item.scope!r}")
    if item.compare not in COMPARES:
        raise InvalidRequestError(f"{where}.compare: expected one of {list(COMPARES)}, got {item.compare!r}")
    threshold = finite_number(item.threshold, f"{where}.threshold")
    if isinstance(item.direction, Feature):
        point, layer, read, bias, floor, feature = _feature_gate(parser, item, where)
    else:
        point = check_hook_point(item.hook, f"{where}.hook")
        layer = parser._layer(item.layer, where)
        direction, _ = parser._vector(item.direction, f"{where}.direction", seen)
        norm = float(direction.norm())
        if norm == 0.0:
            raise InvalidRequestError(f"{where}.direction: must not be the zero vector")
        read, bias, floor, feature = direction / norm, 0.0, -math.inf, None
    if not isinstance(item.items, (list, tuple)) or not item.items:
        raise InvalidRequestError(f"{where}.items: expected a non-empty list of interventions")
    gate = Gate(point, layer, read, bias, floor, threshold, item.compare, item.scope, feature)
    key = f"gate|{point}|{layer}|{bias!r}|{floor!r}|{threshold!r}|{item.compare}|{item.scope}|".encode()
    gate = replace(gate, digest=hashlib.blake2b(key + read.numpy().tobytes(), digest_size=16).digest())
    gated = []
    for i, inner in enumerate(item.items):
        here = f"{where}.items[{i}]"
        if isinstance(inner, When):
            raise InvalidRequestError(f"{here}: a When cannot hold another When")
        for parsed in parser._parse_one(inner, here, seen):
            if site_order(parsed.point, parsed.layer) < site_order(point, layer):
                raise InvalidRequestError(f"{here}.layer: it acts at {parsed.point} of layer {parsed.layer}, before "
                                          f"the gate at {point} of layer {layer}; gated items sit at the gate's point "
                                          "or later")
            gated.append(replace(parsed, gate=gate))
    return gated


def _feature_gate(parser: SpecParser, item: When, where: str) -> tuple:
    """A gate on a registered SAE feature's activation, read at the SAE's own point."""
    feature = item.direction
    here = f"{where}.direction"
    if parser.saes is None:
        raise InvalidRequestError(f"{here}.sae: a feature gate needs an engine with registered SAEs")
    if feature.scale != 1.0 or feature.select is not None:
        raise InvalidRequestError(f"{here}: a gate reads the feature's activation; it takes no scale or select")
    sae = parser.saes.get(feature.sae, f"{here}.sae")
    if not is_int(feature.index) or not 0 <= feature.index < sae.d_sae:
        raise InvalidRequestError(f"{here}.index: {feature.index!r} is not a feature index in [0, {sae.d_sae})")
    if item.layer is not None and parser._layer(item.layer, where) != sae.layer:
        raise InvalidRequestError(f"{where}.layer: {item.layer!r}, but SAE {feature.sae!r} reads layer {sae.layer}")
    if item.hook != sae.hook:
        raise InvalidRequestError(f"{where}.hook: {item.hook!r}, but SAE {feature.sae!r} reads {sae.hook!r}")
    read, bias, floor = sae.feature_read(feature.index)
    return sae.hook, sae.layer, read, bias, floor, (feature.sae, feature.index)


def _lowrank(parser: SpecParser, item: LowRank, where: str, seen: Seen) -> Intervention:
    layer, select = parser._site(item.hook, item.layer, item.select, where, seen)
    hidden = parser.hidden_size
    R = _matrix(item.R, f"{where}.R", None, hidden)
    rank = R.shape[0]
    W = _matrix(item.W, f"{where}.W", rank, hidden)
    b = np.zeros(rank, np.float32) if item.b is None else _array(item.b, f"{where}.b", (rank,))
    deviation = float(np.abs(R.astype(np.float64) @ R.T.astype(np.float64) - np.eye(rank)).max())
    if deviation > ORTHONORMAL_TOL:
        raise InvalidRequestError(f"{where}.R: rows are not orthonormal (max |R R^T - I| = {deviation:.3g}, "
                                  f"tolerance {ORTHONORMAL_TOL:g})")
    return _lowrank_item(item.hook, layer, select, W - R, b, R, np.zeros(hidden, np.float32))


def _affine(parser: SpecParser, item: Affine, where: str, seen: Seen) -> Intervention:
    layer, select = parser._site(item.hook, item.layer, item.select, where, seen)
    hidden = parser.hidden_size
    c = np.zeros(hidden, np.float32) if item.c is None else _array(item.c, f"{where}.c", (hidden,))
    if isinstance(item.A, tuple):
        if len(item.A) != 2:
            raise InvalidRequestError(f"{where}.A: a low-rank A is a tuple (U, V), got {len(item.A)} parts")
        U = _matrix(item.A[0], f"{where}.A.U", hidden, None)
        V = _matrix(item.A[1], f"{where}.A.V", U.shape[1], hidden)
        return _lowrank_item(item.hook, layer, select, V, np.zeros(V.shape[0], np.float32), U.T.copy(), c)
    A = torch.from_numpy(_matrix(item.A, f"{where}.A", hidden, hidden))
    vector = torch.from_numpy(c)
    return Intervention("dense", item.hook, layer, vector, edit_hash("dense", vector, (A,)), select, matrices=(A,))


def _lowrank_item(hook: str, layer: int, select: Any, V: np.ndarray, b: np.ndarray, U: np.ndarray,
                  c: np.ndarray) -> Intervention:
    matrices = tuple(torch.from_numpy(np.ascontiguousarray(part)) for part in (V, b, U))
    vector = torch.from_numpy(c)
    return Intervention("lowrank", hook, layer, vector, edit_hash("lowrank", vector, matrices), select,
                        matrices=matrices)


def _router_bias(parser: SpecParser, item: RouterBias, where: str) -> Intervention:
    layer = parser._layer(item.layer, where)
    experts = parser.router_experts.get(layer)
    if experts is None:
        sparse = sorted(parser.router_experts)
        raise InvalidRequestError(f"{where}.layer: layer {layer} has no router (mixture-of-experts layers: "
                                  f"{sparse if sparse else 'none, this model is dense'})")
    if not is_int(item.expert) or not 0 <= item.expert < experts:
        raise InvalidRequestError(f"{where}.expert: {item.expert!r} is not an expert index in [0, {experts})")
    vector = torch.zeros(experts)
    vector[item.expert] = finite_number(item.bias, f"{where}.bias")
    return Intervention("router", ROUTER_LOGITS, layer, vector, edit_hash("router", vector, ()), None)


def _array(value: Any, where: str, shape: tuple[int | None, ...]) -> np.ndarray:
    """``value`` as a float32 C array of ``shape`` (None: any size there), finite."""
    array = float32_array(value, where)
    if array.ndim != len(shape) or any(want is not None and got != want for got, want in zip(array.shape, shape)):
        expected = "[" + ", ".join("r" if want is None else str(want) for want in shape) + "]"
        raise InvalidRequestError(f"{where}: expected shape {expected} (H = the hidden size), got {list(array.shape)}")
    if array.size == 0:
        raise InvalidRequestError(f"{where}: rank 0; expected at least one row")
    if not np.isfinite(array).all():
        raise InvalidRequestError(f"{where}: contains NaN or Inf")
    return np.array(array, dtype=np.float32, order="C")


def _matrix(value: Any, where: str, rows: int | None, cols: int | None) -> np.ndarray:
    return _array(value, where, (rows, cols))


def as_user_items(items: Sequence[Intervention]) -> list[Any]:
    """Canonical interventions as the items a user writes, with the same effect (a feature add
    comes back as the ``Add`` of its scaled decoder row, a LoReFT as the ``Affine`` it is, gated
    items inside the ``When`` of their gate)."""
    out: list[Any] = []
    gated: dict[bytes, tuple[Gate, list[Any]]] = {}
    for item in items:
        user = _as_user_item(item)
        if item.gate is None:
            out.extend(user)
            continue
        if item.gate.digest not in gated:
            gated[item.gate.digest] = (item.gate, [])
            out.append(item.gate.digest)  # a placeholder where its When goes
        gated[item.gate.digest][1].extend(user)
    return [_as_when(*gated[entry]) if isinstance(entry, bytes) else entry for entry in out]


def _as_user_item(item: Intervention) -> list[Any]:
    if item.kind in ("clamp", "tclamp") and item.feature is not None:
        return [FeatureClamp(*item.feature, value=item.lo, select=item.select, strength=item.strength)]
    if item.kind == "add":
        return [Add(item.layer, item.vector.clone(), item.point, select=item.select)]
    if item.kind == "clamp":
        return [Clamp(item.layer, item.vector.clone(), item.point, min=None if item.lo == -math.inf else item.lo,
                      max=None if item.hi == math.inf else item.hi, strength=item.strength, select=item.select,
                      factor=item.factor)]
    if item.kind == "lowrank":  # h + U^T (V h + b) + c = h + U^T V h + (U^T b + c)
        V, b, U = item.matrices
        return [Affine(item.layer, (U.T.contiguous(), V.clone()), item.vector + U.T @ b, item.point, item.select)]
    if item.kind == "dense":
        return [Affine(item.layer, item.matrices[0].clone(), item.vector.clone(), item.point, item.select)]
    return [RouterBias(item.layer, int(expert), float(item.vector[expert])) for expert in item.vector.nonzero().ravel()]


def _as_when(gate: Gate, items: list[Any]) -> When:
    direction = Feature(*gate.feature) if gate.feature is not None else gate.read.clone()
    return When(items, gate.layer, direction, gate.threshold, gate.point, gate.scope, gate.compare)
