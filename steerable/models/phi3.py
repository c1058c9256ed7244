"""Phi-3 (and 3.5): HF ``Phi3ForCausalLM``. Llama's layer, with the q/k/v projections stored as one
``qkv_proj`` and gate/up as one ``gate_up_proj`` (they load into the same fused parameters, each
rank cutting its heads' rows out of every part), an optional sliding window (Mistral's), and
``longrope`` RoPE scaling (``su`` in older configs): per-frequency short and long factors and a
cos/sin scale, with the factor set chosen once from ``max_model_len`` (``layers/rotary.py``).

Hook points mean what they mean for Llama.
"""

from __future__ import annotations

from typing import Any

from steerable.config import ModelConfig
from steerable.models.llama import LlamaForCausalLM


def phi3_config(hf: Any) -> ModelConfig:
    common = ModelConfig.common(hf)
    params = getattr(hf, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported for Phi-3 (full rotary only)")
    activation = getattr(hf, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act={activation!r} is not supported (Phi-3 uses 'silu')")
    scaling = common["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "longrope":
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != common["head_dim"] // 2:
                raise ValueError(f"rope_scaling.{name} has {len(scaling[name])} factors; "
                                 f"head_dim {common['head_dim']} needs {common['head_dim'] // 2}")
    return ModelConfig(**common, sliding_window=getattr(hf, "sliding_window", None))


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's qkv_proj / gate_up_proj already are our fused parameters' parts, stacked.
    stacked_params: dict[str, tuple[str, int]] = {}
