"""Read a GGUF file's metadata and tensor table straight from a memory map.

gguf-py's ``GGUFReader`` builds a NumPy view for every element of every metadata array: about a
minute for Gemma 3's 262,144-token vocabulary. The engine needs the scalars, the length of the
string arrays and the tensors, so this reader walks the header with ``struct`` and keeps string
arrays as their length; tensor data stays in the map until a tensor is dequantized.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Metadata value types (GGUF spec): fixed-size scalars, then string (8) and array (9).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings (a vocabulary, merges), kept as its length only."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (the file lists dimensions fastest first)
    ggml_type: int
    data: np.ndarray  # the stored bytes (uint8), a view of the memory map

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """``metadata`` (scalars, strings, numeric arrays as NumPy arrays, string arrays as
    ``StringArray``) and ``tensors`` in file order."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != _MAGIC:
            raise ValueError(f"model: {path!r} is not a GGUF file (no GGUF magic)")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in _VERSIONS:
            raise ValueError(f"model: {path!r} is GGUF version {version}; supported: {_VERSIONS}")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.metadata[key] = self._value(kind)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (ndim,) = self._unpack("<I")
            dims = self._unpack(f"<{ndim}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), kind, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        self.tensors = []
        for name, shape, kind, offset in infos:
            size = _nbytes(kind, int(np.prod(shape)))
            if start + offset + size > len(buf):
                raise ValueError(f"model: GGUF tensor {name!r} runs past the end of {path!r} (truncated file?)")
            data = np.frombuffer(buf, dtype=np.uint8, count=size, offset=start + offset)
            self.tensors.append(GGUFTensor(name, shape, kind, data))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._pos = self._pos, self._pos + length
        return self._map[start:self._pos].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"GGUF metadata value of unknown type {kind}")
        element, count = self._unpack("<IQ")
        if element in _NUMPY:
            values = np.frombuffer(self._map, dtype=_NUMPY[element], count=count, offset=self._pos)
            self._pos += values.nbytes
            return values
        if element != _STRING:
            raise ValueError(f"GGUF metadata array of unsupported element type {element}")
        for _ in range(count):  # strings: walk the lengths, keep the count
            (length,) = struct.unpack_from("<Q", self._map, self._pos)
            self._pos += 8 + length
        return StringArray(count)


def _nbytes(kind: int, elements: int) -> int:
    """Bytes of a tensor of ``elements`` of ggml type ``kind`` (block-quantized or plain)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (KeyError, ValueError):
        raise ValueError(f"GGUF tensor of unknown ggml type {kind}") from None
    return elements // block * size
