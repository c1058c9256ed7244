"""Step inputs and outputs as bytes: a JSON header describing the value plus the raw bytes of its
arrays and tensors. No pickle: decoding builds only numbers, strings, containers, numpy arrays,
tensors and the plain step dataclasses named below, whatever the bytes say, so nothing a client
sent can run code on a worker.

Layout: ``[u64 header length][header JSON][raw buffers, each 8-byte aligned]``. Arrays decode as
views of the message buffer (copy-free); the receiver owns a fresh buffer per message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import torch

from steerable.step import (
    BlockTableUpdate,
    CaptureGroup,
    CapturePlan,
    EditSites,
    EditWrite,
    PenaltyInput,
    PromptLogprobsInput,
    SaeUpdate,
    SaeWeights,
    SamplingInput,
    SharedPrefix,
    SteeringPlan,
    SteeringUpdate,
    StepInput,
    StepOutput,
    TableWrite,
    TranscoderDecoders,
    TranscoderWeights,
)

_CLASSES = {cls.__name__: cls for cls in (BlockTableUpdate, CaptureGroup, CapturePlan, EditSites, EditWrite, PenaltyInput,
                                          PromptLogprobsInput, SaeUpdate, SaeWeights, SamplingInput, SharedPrefix,
                                          StepInput, StepOutput, SteeringPlan, SteeringUpdate, TableWrite,
                                          TranscoderDecoders, TranscoderWeights)}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                             torch.int64, torch.int32)}
_NUMPY_DTYPES = {"float32", "float64", "int64", "int32", "bool"}
_HEADER = np.dtype("<u8")


def encode(value: Any) -> bytes:
    buffers: list[bytes] = []
    header = json.dumps(_pack(value, buffers), separators=(",", ":")).encode()
    parts = [np.array([len(header)], dtype=_HEADER).tobytes(), header]
    offset = _HEADER.itemsize + len(header)
    for raw in buffers:
        pad = -offset % 8
        parts += [b"\0" * pad, raw]
        offset += pad + len(raw)
    return b"".join(parts)


def decode(message: memoryview | bytes) -> Any:
    message = memoryview(message)
    size = int(np.frombuffer(message[:_HEADER.itemsize], dtype=_HEADER)[0])
    end = _HEADER.itemsize + size
    return _unpack(json.loads(bytes(message[_HEADER.itemsize:end])), message, [end])


def _pack(value: Any, buffers: list[bytes]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.ndarray):
        buffers.append(np.ascontiguousarray(value).tobytes())
        return {"nd": [str(value.dtype), list(value.shape)]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
        buffers.append(raw.numpy().tobytes())
        return {"t": [str(t.dtype).removeprefix("torch."), list(t.shape)]}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_pack(v, buffers) for v in value]
    if isinstance(value, tuple):
        return {"tu": [_pack(v, buffers) for v in value]}
    if isinstance(value, frozenset):
        return {"fs": [_pack(v, buffers) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_pack(k, buffers), _pack(v, buffers)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and type(value).__name__ in _CLASSES:
        return {"dc": type(value).__name__,
                "f": {f.name: _pack(getattr(value, f.name), buffers) for f in dataclasses.fields(value)}}
    raise TypeError(f"cannot encode {type(value).__name__} in a step message")


def _unpack(tree: Any, message: memoryview, cursor: list[int]) -> Any:
    """``cursor[0]``: where the next raw buffer starts (buffers follow in the order the tree names them)."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [_unpack(v, message, cursor) for v in tree]
    if not isinstance(tree, dict) or len(tree) not in (1, 2):
        raise ValueError("malformed step message")
    if "nd" in tree:
        dtype, shape = tree["nd"]
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"malformed step message: array dtype {dtype!r}")
        return _take(message, cursor, np.dtype(dtype), shape)
    if "t" in tree:
        dtype, shape = tree["t"]
        torch_dtype = _TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            raise ValueError(f"malformed step message: tensor dtype {dtype!r}")
        if torch_dtype == torch.bfloat16:
            return torch.from_numpy(_take(message, cursor, np.dtype(np.int16), shape)).view(torch.bfloat16)
        return torch.from_numpy(_take(message, cursor, np.dtype(dtype), shape))
    if "tu" in tree:
        return tuple(_unpack(v, message, cursor) for v in tree["tu"])
    if "fs" in tree:
        return frozenset(_unpack(v, message, cursor) for v in tree["fs"])
    if "d" in tree:
        return {_unpack(k, message, cursor): _unpack(v, message, cursor) for k, v in tree["d"]}
    if "dc" in tree:
        cls = _CLASSES.get(tree["dc"])
        if cls is None or not isinstance(tree.get("f"), dict):
            raise ValueError(f"malformed step message: class {tree['dc']!r}")
        return cls(**{k: _unpack(v, message, cursor) for k, v in tree["f"].items()})
    raise ValueError("malformed step message")


def _take(message: memoryview, cursor: list[int], dtype: np.dtype, shape: list[int]) -> np.ndarray:
    start = cursor[0] + (-cursor[0] % 8)
    count = int(np.prod(shape)) if shape else 1
    end = start + count * dtype.itemsize
    if end > len(message):
        raise ValueError("malformed step message: truncated")
    cursor[0] = end
    return np.frombuffer(message[start:end], dtype=dtype).reshape(shape)
