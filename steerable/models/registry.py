"""HF ``architectures`` name -> our implementation."""

from __future__ import annotations

from torch import nn

from steerable.models.llama import LlamaForCausalLM
from steerable.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    _MODELS[architecture] = cls


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {sorted(_MODELS)}") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
