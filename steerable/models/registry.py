"""HF ``architectures`` name -> our implementation and the config adapter that reads its HF config.

Adding a family: one model file (its layer, a ``CausalLM`` subclass and its config adapter), one
line here, tests. ``docs/models.md`` walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from steerable.config import ModelConfig
from steerable.models import gemma2, gemma3, gpt2, gpt_neox, llama, olmo2, phi3, qwen3_moe
from steerable.models.base import CausalLM

_MODELS: dict[str, tuple[type[CausalLM], Callable[[Any], ModelConfig]]] = {
    "LlamaForCausalLM": (llama.LlamaForCausalLM, llama.llama_config),
    "MistralForCausalLM": (llama.LlamaForCausalLM, llama.mistral_config),
    "Qwen2ForCausalLM": (llama.LlamaForCausalLM, llama.qwen2_config),
    "Qwen3ForCausalLM": (llama.LlamaForCausalLM, llama.qwen3_config),
    "Qwen3MoeForCausalLM": (qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.qwen3_moe_config),
    "Gemma3ForCausalLM": (gemma3.Gemma3ForCausalLM, gemma3.gemma3_config),
    "Gemma3ForConditionalGeneration": (gemma3.Gemma3ForCausalLM, gemma3.gemma3_config),
    "Gemma2ForCausalLM": (gemma2.Gemma2ForCausalLM, gemma2.gemma2_config),
    "Olmo2ForCausalLM": (olmo2.Olmo2ForCausalLM, olmo2.olmo2_config),
    "Phi3ForCausalLM": (phi3.Phi3ForCausalLM, phi3.phi3_config),
    "GPT2LMHeadModel": (gpt2.GPT2LMHeadModel, gpt2.gpt2_config),
    "GPTNeoXForCausalLM": (gpt_neox.GPTNeoXForCausalLM, gpt_neox.gpt_neox_config),
}


def _entry(architecture: str) -> tuple[type[CausalLM], Callable[[Any], ModelConfig]]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {sorted(_MODELS)}") from None


def model_class(architecture: str) -> type[CausalLM]:
    return _entry(architecture)[0]


def resolve_model_config(hf_config: Any) -> tuple[type[CausalLM], ModelConfig]:
    """The implementation for an HF config and the config adapted for it (errors before allocating)."""
    cls, adapter = _entry(ModelConfig.architecture_of(hf_config))
    return cls, adapter(hf_config)
