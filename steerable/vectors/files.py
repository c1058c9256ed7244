"""Control vectors on disk: llama.cpp's control-vector GGUF (as repeng writes it) and safetensors.

GGUF layout (what llama.cpp reads): ``general.architecture = "controlvector"``,
``controlvector.model_hint`` (the HF ``model_type``), ``controlvector.layer_count`` (u32, the number
of directions, as repeng writes it) and one F32 1-D tensor ``direction.N`` per layer, N the 0-based
block index, added to that block's output: steerable's ``post_mlp`` of layer N. llama.cpp reads
only the tensors, so GGUF carries no training metadata; safetensors keeps the hook and all of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from steerable.errors import InvalidRequestError
from steerable.files import write_safetensors
from steerable.hook_points import POST_MLP
from steerable.vectors.control_vector import ControlVector

ARCHITECTURE = "controlvector"
SAFETENSORS_FORMAT = "steerable-control-vector-v1"
_DIRECTION = re.compile(r"direction\.(\d+)")


def save(cv: ControlVector, path: str | os.PathLike) -> None:
    suffix = Path(path).suffix
    if suffix == ".gguf":
        save_gguf(cv, path)
    elif suffix == ".safetensors":
        save_safetensors(cv, path)
    else:
        raise InvalidRequestError(f"path: {str(path)!r} must end in .gguf or .safetensors")


def load(path: str | os.PathLike) -> ControlVector:
    suffix = Path(path).suffix
    if suffix not in (".gguf", ".safetensors"):
        raise InvalidRequestError(f"path: {str(path)!r} must end in .gguf or .safetensors")
    if not os.path.isfile(path):
        raise InvalidRequestError(f"path: control vector file {str(path)!r} does not exist")
    return load_gguf(path) if suffix == ".gguf" else load_safetensors(path)


def load_bytes(data: bytes, where: str = "control_vector") -> ControlVector:
    """A control vector file's contents as sent over HTTP: GGUF (by its magic) or safetensors. The
    bytes are parsed by the format readers, never unpickled."""
    suffix = ".gguf" if data[:4] == b"GGUF" else ".safetensors"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"vector{suffix}"
        path.write_bytes(data)
        try:
            return load(path)
        except Exception as err:  # a malformed file, whatever the reader trips on; the temp path means nothing
            reason = str(err).replace(str(path), "the file")
            raise InvalidRequestError(f"{where}: not a usable .gguf or .safetensors control vector ({reason})") from None


# ---------------------------------------------------------------- GGUF

def save_gguf(cv: ControlVector, path: str | os.PathLike) -> None:
    """Write the repeng layout; only ``post_mlp`` vectors of layers >= 1 fit it."""
    import gguf

    if cv.hook != POST_MLP:
        raise InvalidRequestError(f"hook: a GGUF control vector is added to each block's output (post_mlp); this "
                                  f"one is at {cv.hook!r}, so save it as .safetensors instead")
    if 0 in cv.directions:
        raise InvalidRequestError("layers: llama.cpp rejects direction.0 (block 0's output is never steered there); "
                                  "drop layer 0 with cv.in_layer_range(1, ...) or save as .safetensors")
    with _replacing(path) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCHITECTURE)
        writer.add_string(f"{ARCHITECTURE}.model_hint", str(cv.metadata.get("model_hint") or ""))
        writer.add_uint32(f"{ARCHITECTURE}.layer_count", len(cv.directions))
        for layer, vector in cv.directions.items():
            writer.add_tensor(f"direction.{layer}", vector.numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def load_gguf(path: str | os.PathLike) -> ControlVector:
    """Read a llama.cpp / repeng control vector; a model GGUF or a malformed tensor fails naming it."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as err:
        raise InvalidRequestError(f"{path}: not a readable GGUF file ({err})") from None
    fields = {name: f.contents() for name, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch is not None and arch != ARCHITECTURE:
        raise InvalidRequestError(f"{path}: general.architecture is {arch!r}, not {ARCHITECTURE!r} (a model file?)")
    directions = {}
    for tensor in reader.tensors:
        match = _DIRECTION.fullmatch(tensor.name)
        if match is None:
            raise InvalidRequestError(f"{path}: tensor {tensor.name!r} is not named direction.N")
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or len(tensor.shape) != 1:
            raise InvalidRequestError(f"{path}: tensor {tensor.name!r} must be a 1-D F32 vector, got "
                                      f"{tensor.tensor_type.name} of shape {list(tensor.shape)}")
        directions[int(match.group(1))] = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    if not directions:
        raise InvalidRequestError(f"{path}: no direction.N tensors")
    metadata = {"model_hint": fields.get(f"{ARCHITECTURE}.model_hint") or None, "layers": sorted(directions)}
    return _checked(directions, POST_MLP, metadata, path)


# ---------------------------------------------------------------- safetensors

def save_safetensors(cv: ControlVector, path: str | os.PathLike) -> None:
    """``direction.N`` tensors plus the hook and the training metadata (JSON) in the header."""
    metadata = dict(cv.metadata)
    if "residual_norm" in metadata:
        metadata["residual_norm"] = {str(k): float(v) for k, v in metadata["residual_norm"].items()}
    header = {"format": SAFETENSORS_FORMAT, "hook": cv.hook, "metadata": json.dumps(metadata)}
    with _replacing(path) as tmp:
        write_safetensors({f"direction.{layer}": v.clone() for layer, v in cv.directions.items()}, tmp, metadata=header)


def load_safetensors(path: str | os.PathLike) -> ControlVector:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != SAFETENSORS_FORMAT:
                raise InvalidRequestError(f"{path}: not a steerable control vector (format={header.get('format')!r})")
            directions = {}
            for name in f.keys():
                match = _DIRECTION.fullmatch(name)
                if match is None:
                    raise InvalidRequestError(f"{path}: tensor {name!r} is not named direction.N")
                directions[int(match.group(1))] = f.get_tensor(name)
    except SafetensorError as err:
        raise InvalidRequestError(f"{path}: not a readable safetensors file ({err})") from None
    try:
        metadata = json.loads(header.get("metadata") or "{}")
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"{path}: metadata is not JSON ({err})") from None
    if "residual_norm" in metadata:
        metadata["residual_norm"] = {int(k): float(v) for k, v in metadata["residual_norm"].items()}
    return _checked(directions, header.get("hook", POST_MLP), metadata, path)


# ---------------------------------------------------------------- shared

def _checked(directions: dict, hook: str, metadata: dict, path: str | os.PathLike) -> ControlVector:
    try:
        return ControlVector(directions, hook, metadata)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"{path}: {err}") from None


@contextlib.contextmanager
def _replacing(path: str | os.PathLike) -> Iterator[str]:
    """A temp path beside ``path`` that replaces it on success: readers never see half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
