"""``SparseFeatures``: each captured row's top SAE features, and their wire form.

On the device and through the capture plane's staging, delivery and stores a row of features is
one float32 row ``[indices as int32 bits | values]`` (``2 * top_k`` wide), so it travels exactly as
hidden states do; ``SparseFeatures.unpack`` splits it when the rows reach a caller.

Wire form (one SAE's rows; base64 byte fields in JSON, like other captures)::

    {"encoding": "sparse", "shape": [rows, top_k], "indices": <int32 LE>, "values": <float32 LE>,
     "meta": {"req_table": [...], "req_idx": ..., "positions": ..., "token_ids": ...}, "layout": {...}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from steerable.errors import InvalidRequestError

SPARSE_ENCODING = "sparse"
_I32, _F32 = np.dtype("<i4"), np.dtype("<f4")


@dataclass
class SparseFeatures:
    """Per row the ``top_k`` highest feature activations, highest first: ``indices`` int32 and
    ``values`` float32, both ``[rows, top_k]``; a row with fewer active features pads with index -1
    and value 0.0."""

    indices: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.indices.shape != self.values.shape or self.indices.ndim != 2:
            raise InvalidRequestError(f"SparseFeatures: indices {tuple(self.indices.shape)} and values "
                                      f"{tuple(self.values.shape)} must both be [rows, top_k]")

    def __len__(self) -> int:
        return self.indices.shape[0]

    def __repr__(self) -> str:
        active = (self.indices >= 0).sum(1).float().mean().item() if len(self) else 0.0
        return f"SparseFeatures(rows={len(self)}, top_k={self.top_k}, active per row={active:.1f})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SparseFeatures):
            return NotImplemented
        return torch.equal(self.indices, other.indices) and torch.equal(self.values, other.values)

    @property
    def top_k(self) -> int:
        return self.indices.shape[1]

    def dense(self, d_sae: int) -> torch.Tensor:
        """float32 ``[rows, d_sae]`` with the kept activations in place and zeros elsewhere."""
        out = torch.zeros(len(self), d_sae, dtype=torch.float32)
        kept = self.indices >= 0
        rows = torch.arange(len(self)).unsqueeze(1).expand_as(self.indices)
        out[rows[kept], self.indices[kept].long()] = self.values[kept]
        return out

    def select(self, rows: torch.Tensor | slice) -> "SparseFeatures":
        return SparseFeatures(self.indices[rows], self.values[rows])

    @staticmethod
    def unpack(packed: torch.Tensor) -> "SparseFeatures":
        """From staged rows ``[rows, 2 * top_k]`` (float32 bits of the indices, then the values)."""
        k = packed.shape[-1] // 2
        return SparseFeatures(packed[:, :k].contiguous().view(torch.int32), packed[:, k:].contiguous())

    @staticmethod
    def unpack_layers(packed: torch.Tensor) -> "SparseFeatures":
        """From staged rows of several layers ``[layers, rows, 2 * top_k]`` (a multi-layer transcoder,
        whose feature indices are flat over its layers): each row's ``top_k`` highest over all of
        them, highest first (ties to the earlier layer)."""
        if packed.shape[0] == 1:
            return SparseFeatures.unpack(packed[0])
        k = packed.shape[-1] // 2
        indices = packed[..., :k].contiguous().view(torch.int32).permute(1, 0, 2).reshape(packed.shape[1], -1)
        values = packed[..., k:].permute(1, 0, 2).reshape(packed.shape[1], -1)
        order = torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]
        top, kept = values.gather(-1, order), indices.gather(-1, order)
        return SparseFeatures(torch.where(top > 0, kept, -1).contiguous(), torch.where(top > 0, top, 0.0).contiguous())

    @staticmethod
    def empty(top_k: int) -> "SparseFeatures":
        return SparseFeatures(torch.empty(0, top_k, dtype=torch.int32), torch.empty(0, top_k, dtype=torch.float32))

    @staticmethod
    def cat(parts: Sequence["SparseFeatures"]) -> "SparseFeatures":
        return SparseFeatures(torch.cat([p.indices for p in parts]), torch.cat([p.values for p in parts]))


def serialize_sparse(features: SparseFeatures, meta: dict[str, Any], layout: Mapping[str, Any] | None
                     ) -> dict[str, Any]:
    """One SAE's rows as a wire dict; ``meta``: the label columns as ``serialize_capture_layer`` packs them."""
    out: dict[str, Any] = {
        "encoding": SPARSE_ENCODING,
        "shape": [len(features), features.top_k],
        "indices": features.indices.numpy().astype(_I32, copy=False).tobytes(),
        "values": features.values.numpy().astype(_F32, copy=False).tobytes(),
        "meta": meta,
    }
    if layout is not None:
        out["layout"] = dict(layout)
    return out


def deserialize_sparse(name: str, info: Mapping[str, Any], as_bytes: Any) -> SparseFeatures:
    """``as_bytes(value, what)``: raw bytes of a field (base64 text in JSON)."""
    shape = info.get("shape")
    if (not isinstance(shape, (list, tuple)) or len(shape) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise InvalidRequestError(f"capture {name!r} has invalid shape {shape!r}; expected [rows, top_k]")
    rows, k = shape
    columns = []
    for field, dtype in (("indices", _I32), ("values", _F32)):
        data = as_bytes(info.get(field), f"capture {name!r} {field}")
        if len(data) != rows * k * dtype.itemsize:
            raise InvalidRequestError(f"capture {name!r} {field} carries {len(data)} bytes, expected {rows}x{k}x4")
        columns.append(torch.from_numpy(np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("=")))
                       .reshape(rows, k))
    return SparseFeatures(*columns)
