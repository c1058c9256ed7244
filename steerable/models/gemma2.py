"""Gemma 2: HF ``Gemma2ForCausalLM``. Gemma 3's layer (sandwich ``(1 + w)`` RMSNorms, GeGLU, the
``query_pre_attn_scalar`` query scale, embeddings scaled by ``sqrt(hidden_size)``) without the
per-head q/k norms, with one RoPE base for every layer, sliding-window and global layers
alternating (layer 0 local), and two soft-caps: attention scores become ``cap * tanh(s / cap)``
inside the attention kernel before the mask and softmax (``attn_logit_softcapping``, 50 in the
releases), and logits likewise (``final_logit_softcapping``, 30).

Hook points mean what they mean for Gemma 3: ``post_attn`` is the residual after the attention add,
which adds the post-attention-normed output.
"""

from __future__ import annotations

from typing import Any

from steerable.config import ModelConfig
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.gemma3 import SLIDING, Gemma3Config, Gemma3ForCausalLM, layer_types

_PATTERN = 2  # sliding, global, sliding, ... when a config has no layer_types


def _cap(text: Any, name: str) -> float | None:
    value = getattr(text, name, None)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number or null, got {value!r}")
    return float(value)


def gemma2_config(hf: Any) -> Gemma3Config:
    activation = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={activation!r} is not supported (Gemma 2 uses 'gelu_pytorch_tanh')")
    common = ModelConfig.common(hf)
    if common["rope_scaling"] is not None:
        raise ValueError(f"rope scaling {common['rope_scaling']['rope_type']!r} is not supported for Gemma 2")
    types = layer_types(hf, common["num_layers"], _PATTERN)
    window = getattr(hf, "sliding_window", None)
    if SLIDING in types and (window is None or window < 1):
        raise ValueError(f"sliding_window must be >= 1 for sliding-attention layers, got {window!r}")
    return Gemma3Config(**common, attention_bias=bool(getattr(hf, "attention_bias", False)),
                        attn_logit_softcapping=_cap(hf, "attn_logit_softcapping"),
                        layer_windows=[window if t == SLIDING else None for t in types],
                        local_rope_theta=common["rope_theta"],
                        query_pre_attn_scalar=float(getattr(hf, "query_pre_attn_scalar", 256)),
                        final_logit_softcapping=_cap(hf, "final_logit_softcapping"))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    def make_shared(self, cfg: Gemma3Config, max_positions: int) -> dict[str, RotaryEmbedding]:
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)  # one table for both kinds of layer
        return {"global": rotary, "local": rotary}
