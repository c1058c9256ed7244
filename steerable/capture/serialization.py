"""Capture wire format: labelled per-layer tensors as raw bytes.

Captured rows cross a process boundary (worker -> engine -> client), so each layer travels
as the raw bytes of its *stored* dtype (bf16 as int16 bytes: no float32 upcast, the wire
volume equals the stored volume) together with mandatory row labels.  Labels are what make
a capture usable under continuous batching: without them the client cannot tell which
request and position a row belongs to, so unlabelled or inconsistent payloads raise rather
than being silently misaligned.

Per layer::

    {"encoding": "raw", "dtype": "torch.bfloat16", "shape": [rows, width], "data": bytes,
     "meta": {"req_table": [str, ...], "req_idx": bytes, "positions": bytes,
              "token_ids": bytes},
     "layout": {...}}            # optional, e.g. {"num_heads": 16, "head_size": 64}

Label columns are little-endian int32; ``req_idx`` indexes ``req_table``. In JSON (an HTTP
response) the four byte fields are base64 strings, which ``deserialize_captured`` reads as well.

Attention patterns (``AttentionPatterns``) are ragged: ``"shape": [rows, heads]``, ``"data"`` the
rows' ``[heads, key_len]`` values one after another, and a ``"ragged"`` entry with the kept
``heads`` and the int32 ``key_starts`` / ``key_lens`` columns (base64 in JSON too).
SAE features are keyed by SAE name instead of layer and travel as ``SparseFeatures``
(``steerable.capture.sparse``: ``"encoding": "sparse"``) with the same labels. A transcoder's error
node is keyed by its name too: a raw payload with ``"sae": name`` whose shape is ``[rows, width]``,
or ``[rows, layers, width]`` for a transcoder of several layers.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from steerable.capture.patterns import AttentionPatterns
from steerable.capture.sparse import SPARSE_ENCODING, SparseFeatures, deserialize_sparse, serialize_sparse
from steerable.errors import InvalidRequestError

__all__ = ["CaptureMeta", "WIRE_DTYPES", "serialize_capture_layer", "serialize_captured", "deserialize_captured",
           "match_capture_request_id"]

ENCODING = "raw"

WIRE_DTYPES: dict[str, torch.dtype] = {
    "torch.float32": torch.float32,
    "torch.float16": torch.float16,
    "torch.bfloat16": torch.bfloat16,
    "torch.float64": torch.float64,
}
_WIRE_NAMES: dict[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}
# Explicit little-endian byte layouts; numpy has no bfloat16, so bf16 rides as int16 bits.
_RAW: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype("<f4"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
    torch.float64: np.dtype("<f8"),
}
_I32 = np.dtype("<i4")
_SUFFIX = re.compile(r"[0-9a-f]{8}")


class CaptureMeta:
    """Row labels for one captured layer: request id, absolute position and input token id.

    ``positions``/``token_ids`` are int32 with -1 for synthesized rows (e.g. a 'mean'
    reduction has no single position or token).
    """

    __slots__ = ("req_ids", "positions", "token_ids")
    __hash__ = None  # type: ignore[assignment]  # mutable tensors: equality only

    def __init__(self, req_ids: Sequence[str], positions: torch.Tensor | Sequence[int],
                 token_ids: torch.Tensor | Sequence[int]):
        self.req_ids: list[str] = list(req_ids)
        self.positions: torch.Tensor = torch.as_tensor(positions, dtype=torch.int32)
        self.token_ids: torch.Tensor = torch.as_tensor(token_ids, dtype=torch.int32)
        n = len(self.req_ids)
        if self.positions.shape != (n,) or self.token_ids.shape != (n,):
            raise InvalidRequestError(f"CaptureMeta columns disagree: {n} req_ids, positions "
                             f"{tuple(self.positions.shape)}, token_ids {tuple(self.token_ids.shape)}")

    def __len__(self) -> int:
        return len(self.req_ids)

    def __repr__(self) -> str:
        reqs = list(dict.fromkeys(self.req_ids))
        more = f", ... (+{len(reqs) - 3})" if len(reqs) > 3 else ""
        return (f"CaptureMeta(rows={len(self)}, requests={reqs[:3]}{more}, "
                f"positions={self.positions.tolist()[:8]}{'...' if len(self) > 8 else ''})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CaptureMeta):
            return NotImplemented
        return (self.req_ids == other.req_ids and torch.equal(self.positions, other.positions)
                and torch.equal(self.token_ids, other.token_ids))

    def select(self, rows: torch.Tensor | slice) -> CaptureMeta:
        """Labels of a row subset: a slice, an index tensor or a boolean mask (as for the data)."""
        if isinstance(rows, slice):
            return CaptureMeta(self.req_ids[rows], self.positions[rows], self.token_ids[rows])
        rows = torch.as_tensor(rows)
        idx = rows.nonzero().flatten() if rows.dtype == torch.bool else rows.long().flatten()
        if rows.dtype == torch.bool and rows.shape != (len(self),):
            raise InvalidRequestError(f"mask of shape {tuple(rows.shape)} for {len(self)} rows")
        return CaptureMeta([self.req_ids[i] for i in idx.tolist()], self.positions[idx],
                           self.token_ids[idx])

    def by_request(self) -> torch.Tensor:
        """A permutation grouping rows by request (requests in the order of their first row, each
        request's rows kept in order): index the data with it and ``select`` the labels."""
        first: dict[str, int] = {}
        keys = np.fromiter((first.setdefault(r, len(first)) for r in self.req_ids), np.int64, len(self.req_ids))
        return torch.from_numpy(np.argsort(keys, kind="stable"))

    @staticmethod
    def concat(metas: Sequence[CaptureMeta]) -> CaptureMeta:
        """Stack labels in order, matching ``torch.cat`` of the corresponding tensors."""
        if not metas:
            return CaptureMeta([], torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32))
        return CaptureMeta([r for m in metas for r in m.req_ids], torch.cat([m.positions for m in metas]),
                           torch.cat([m.token_ids for m in metas]))


def _req_index(req_ids: Sequence[str]) -> tuple[list[str], torch.Tensor]:
    """(table, int32 req_idx): unique ids in first-seen order, so labels stay compact on disk/wire."""
    lookup: dict[str, int] = {}
    idx = [lookup.setdefault(r, len(lookup)) for r in req_ids]
    return list(lookup), torch.tensor(idx, dtype=torch.int32)


def _i32_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().numpy().astype(_I32, copy=False).tobytes()


def serialize_capture_layer(tensor: torch.Tensor, labels: torch.Tensor, req_table: Sequence[str],
                            layout: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Pack one layer's rows and their (req_idx, position, token_id) labels for transport.

    Everything is validated here so a malformed capture fails at its source, not in a client.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2:
        raise InvalidRequestError(f"capture tensor must be a 2-D [rows, width] tensor, got "
                         f"{getattr(tensor, 'shape', type(tensor).__name__)}")
    if tensor.dtype not in _WIRE_NAMES:
        raise InvalidRequestError(f"unsupported capture dtype {tensor.dtype}; expected one of {list(WIRE_DTYPES)}")
    if (not isinstance(labels, torch.Tensor) or labels.dtype != torch.int32 or labels.ndim != 2
            or labels.shape[1] != 3):
        raise InvalidRequestError(f"capture labels must be int32 [rows, 3], got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
    rows = tensor.shape[0]
    if labels.shape[0] != rows:
        raise InvalidRequestError(f"capture labels have {labels.shape[0]} rows but data has {rows}")
    table = list(req_table)
    if not all(isinstance(r, str) for r in table):
        raise InvalidRequestError("req_table must contain request id strings")
    labels = labels.detach().cpu()
    if rows and (int(labels[:, 0].min()) < 0 or int(labels[:, 0].max()) >= len(table)):
        raise InvalidRequestError(f"capture req_idx outside req_table of {len(table)} entries")
    out: dict[str, Any] = {
        "encoding": ENCODING,
        "dtype": _WIRE_NAMES[tensor.dtype],
        "shape": [int(rows), int(tensor.shape[1])],
        "data": _raw_bytes(tensor),
        "meta": {"req_table": table, "req_idx": _i32_bytes(labels[:, 0]),
                 "positions": _i32_bytes(labels[:, 1]), "token_ids": _i32_bytes(labels[:, 2])},
    }
    if layout is not None:
        out["layout"] = dict(layout)
    return out


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as the wire's little-endian bytes of its dtype (bf16 as int16 bits)."""
    data = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return data.numpy().astype(_RAW[tensor.dtype], copy=False).tobytes()


def serialize_captured(tensors: Mapping[Any, torch.Tensor | SparseFeatures], metas: Mapping[Any, CaptureMeta],
                       layouts: Mapping[Any, Mapping[str, Any]] | None = None, text: bool = False
                       ) -> dict[Any, dict[str, Any]]:
    """Inverse of ``deserialize_captured``: per-layer (per-SAE for ``SparseFeatures``) wire dicts.
    With ``text=True`` the result is JSON-ready (keys as strings, byte fields base64) for an HTTP
    response."""
    out: dict[Any, dict[str, Any]] = {}
    for layer, tensor in tensors.items():
        meta = metas[layer]
        table, req_idx = _req_index(meta.req_ids)
        labels = torch.stack([req_idx, meta.positions, meta.token_ids], dim=1) if len(meta) else \
            torch.empty(0, 3, dtype=torch.int32)
        layout = (layouts or {}).get(layer)
        ragged = tensor if isinstance(tensor, AttentionPatterns) else None
        if isinstance(tensor, SparseFeatures):
            if len(tensor) != len(meta):
                raise InvalidRequestError(f"capture labels have {len(meta)} rows but {layer!r} has {len(tensor)}")
            wire = serialize_sparse(tensor, {"req_table": table, "req_idx": _i32_bytes(labels[:, 0]),
                                             "positions": _i32_bytes(labels[:, 1]),
                                             "token_ids": _i32_bytes(labels[:, 2])}, layout)
        elif ragged is not None:  # labels and dtype checked on an empty [rows, heads] stand-in
            stand_in = torch.empty(len(ragged), len(ragged.heads), dtype=ragged.dtype or torch.float32)
            wire = serialize_capture_layer(stand_in, labels, table, layout)
            wire["data"] = _raw_bytes(torch.cat([r.reshape(-1) for r in ragged.rows])) if len(ragged) else b""
            wire["ragged"] = {"heads": list(ragged.heads), "key_starts": _i32_bytes(ragged.key_starts),
                              "key_lens": _i32_bytes(ragged.key_lens)}
        elif isinstance(layer, str) and not layer.isdecimal():  # a dictionary's dense rows (transcoder_error)
            wire = serialize_capture_layer(tensor.reshape(tensor.shape[0], -1), labels, table, layout)
            wire["shape"], wire["sae"] = [int(s) for s in tensor.shape], layer
        else:
            wire = serialize_capture_layer(tensor, labels, table, layout)
        if text:
            wire = {k: _b64(v) if isinstance(v, bytes) else v for k, v in wire.items()}
            wire["meta"] = {k: _b64(v) if isinstance(v, bytes) else v for k, v in wire["meta"].items()}
            if ragged is not None:
                wire["ragged"] = {k: _b64(v) if isinstance(v, bytes) else v for k, v in wire["ragged"].items()}
        out[str(layer) if text else layer] = wire
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _as_bytes(value: Any, what: str) -> bytes | bytearray | memoryview:
    """Raw bytes as given, or decoded from the base64 text of a JSON payload."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{what} is not valid base64") from None
    raise InvalidRequestError(f"{what} is missing or not bytes")


def _layer_key(key: object) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdecimal():
        return int(key)
    raise InvalidRequestError(f"capture layer key {key!r} is not a layer number")


def _column(meta: Mapping[str, Any], name: str, layer: Any, rows: int) -> np.ndarray:
    buf = _as_bytes(meta.get(name), f"capture layer {layer} label column {name!r}")
    if len(buf) != rows * _I32.itemsize:
        raise InvalidRequestError(f"capture layer {layer} label column {name!r} has {len(buf)} bytes "
                         f"for {rows} rows; labels are inconsistent with the data")
    return np.frombuffer(buf, dtype=_I32).astype(np.int32)


def _is_sparse(info: Any) -> bool:
    return isinstance(info, Mapping) and info.get("encoding") == SPARSE_ENCODING


def _is_named(info: Any) -> bool:
    """A dense payload keyed by a dictionary's name (its ``"sae"``), not by a layer."""
    return isinstance(info, Mapping) and isinstance(info.get("sae"), str) and bool(info["sae"])


def deserialize_captured(serialized: Mapping[Any, Mapping[str, Any]]
                         ) -> tuple[dict[Any, torch.Tensor | SparseFeatures], dict[Any, CaptureMeta]]:
    """Rebuild per-layer tensors (bit-exact) and their row labels, keyed by int layer id; SAE
    features (``"encoding": "sparse"``) come back as ``SparseFeatures`` keyed by SAE name.

    Keys come back sorted.  A ``layout`` entry is not interpreted here; read it from the wire dict.
    """
    tensors: dict[Any, torch.Tensor | SparseFeatures] = {}
    metas: dict[Any, CaptureMeta] = {}
    items = [(str(k) if _is_sparse(v) or _is_named(v) else _layer_key(k), v) for k, v in serialized.items()]
    for layer, info in sorted(items, key=lambda kv: (isinstance(kv[0], str), kv[0])):
        if layer in tensors:
            raise InvalidRequestError(f"capture layer {layer} appears twice")
        if not isinstance(info, Mapping):
            raise InvalidRequestError(f"capture layer {layer} payload is not a mapping")
        if _is_sparse(info):
            tensors[layer] = deserialize_sparse(layer, info, _as_bytes)
            metas[layer] = _labels(info.get("meta"), layer, len(tensors[layer]))
            continue
        if info.get("encoding") != ENCODING:
            raise InvalidRequestError(f"unknown capture wire encoding {info.get('encoding')!r} for layer {layer}; "
                             "engine and client versions differ")
        dtype = WIRE_DTYPES.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise InvalidRequestError(f"unknown capture wire dtype {info.get('dtype')!r} for layer {layer}")
        shape = info.get("shape")
        named = _is_named(info) and isinstance(shape, (list, tuple)) and len(shape) == 3  # [rows, layers, width]
        if (not isinstance(shape, (list, tuple)) or len(shape) != 2 + named
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise InvalidRequestError(f"capture layer {layer} has invalid shape {shape!r}; expected [rows, width]")
        rows, width = shape[0], int(np.prod(shape[1:]))
        data = _as_bytes(info.get("data"), f"capture layer {layer} data")
        raw = _RAW[dtype]
        ragged = _ragged(info.get("ragged"), layer, rows, width) if "ragged" in info else None
        values = rows * width if ragged is None else width * int(ragged[2].sum())
        if len(data) != values * raw.itemsize:
            raise InvalidRequestError(f"capture layer {layer} carries {len(data)} bytes, expected "
                             f"{values}x{raw.itemsize}")
        # astype to the native dtype copies: the result is writable and owns its memory.
        arr = np.frombuffer(data, dtype=raw).astype(raw.newbyteorder("="))
        tensor = torch.from_numpy(arr)
        if dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        if ragged is None:
            tensor = tensor.reshape(*shape)
        else:
            heads, starts, lens = ragged
            pieces = torch.split(tensor, (lens.astype(np.int64) * width).tolist()) if rows else []
            tensor = AttentionPatterns([p.view(width, -1) for p, n in zip(pieces, lens.tolist())],
                                       torch.from_numpy(starts), torch.from_numpy(lens), heads)
        tensors[layer] = tensor
        metas[layer] = _labels(info.get("meta"), layer, rows)
    return tensors, metas


def _ragged(info: Any, layer: int, rows: int, heads: int) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(heads, key_starts, key_lens) of an attention-pattern layer, checked against its shape."""
    if not isinstance(info, Mapping):
        raise InvalidRequestError(f"capture layer {layer} has an invalid 'ragged' entry")
    kept = info.get("heads")
    if not isinstance(kept, list) or len(kept) != heads or not all(isinstance(h, int) for h in kept):
        raise InvalidRequestError(f"capture layer {layer}: 'ragged.heads' must list its {heads} heads")
    starts = _column(info, "key_starts", layer, rows)
    lens = _column(info, "key_lens", layer, rows)
    if rows and (lens.min() < 1 or starts.min() < 0):
        raise InvalidRequestError(f"capture layer {layer}: key ranges must be non-empty and start at >= 0")
    return kept, starts, lens


def _labels(meta: Any, layer: Any, rows: int) -> CaptureMeta:
    if not isinstance(meta, Mapping):
        raise InvalidRequestError(f"capture layer {layer} is missing its row labels ('meta'); unlabelled "
                                  "payloads cannot be aligned to requests")
    table = meta.get("req_table")
    if not isinstance(table, (list, tuple)) or not all(isinstance(r, str) for r in table):
        raise InvalidRequestError(f"capture layer {layer} has no valid req_table")
    req_idx = _column(meta, "req_idx", layer, rows)
    positions = _column(meta, "positions", layer, rows)
    token_ids = _column(meta, "token_ids", layer, rows)
    if rows and (req_idx.min() < 0 or req_idx.max() >= len(table)):
        raise InvalidRequestError(f"capture layer {layer} has req_idx outside its req_table of {len(table)}")
    return CaptureMeta([table[i] for i in req_idx.tolist()], torch.from_numpy(positions), torch.from_numpy(token_ids))


def match_capture_request_id(label: str, request_id: str) -> bool:
    """Whether a row label belongs to a client request.

    Rows carry the engine-internal id: the client id, or the client id plus ``-`` and exactly
    8 lowercase hex chars.  Anything looser (a bare prefix test) would give ``req-1`` the rows
    of ``req-10-...``.
    """
    if label == request_id:
        return True
    n = len(request_id)
    return (len(label) == n + 9 and label.startswith(request_id) and label[n] == "-"
            and _SUFFIX.fullmatch(label, n + 1) is not None)
