"""Gemma 3 text models: HF ``Gemma3ForCausalLM`` (``gemma3_text``) and the text tower of
``Gemma3ForConditionalGeneration`` (its vision tower and projector are skipped at load).

The layer is ``h = x + post_attention_norm(attn(input_norm(x)))``, ``out = h +
post_feedforward_norm(mlp(pre_feedforward_norm(h)))``: "sandwich" norms, each an RMSNorm scaled by
``1 + weight`` in float32. Attention has per-head q/k norms before RoPE and the scale
``query_pre_attn_scalar ** -0.5``; sliding-window layers use the local RoPE base, full layers the
global one with its scaling (linear x8 from 4B up). Embeddings are scaled by ``sqrt(hidden_size)``
rounded to the weight dtype, as HF does (25.25 in bfloat16 for the 270M).

Hook points mean what they mean for every model: ``post_attn`` is the residual after the attention
add, which here adds the post-attention-normed output; ``mlp_in`` is the pre-feed-forward norm's
output and ``mlp_out`` the post-feed-forward norm's (what the residual adds), where Gemma Scope's
transcoders read and write.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig, rope_parameters
from steerable.hook_points import MLP_OUT, POST_ATTN, HookPoints, PostNormed, unpack_delta
from steerable.layers import fused, logit_kernels
from steerable.layers.norm import GemmaRMSNorm
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
# Where the final logit soft-cap (``final_logit_softcapping``: Gemma 2) runs: "torch", HF's three
# PyTorch ops (three reads and writes of the logits); "kernel", one Triton kernel in place with the
# same rounding; "sampler", inside the fused sampler's registers where a decode step samples there
# (the kernel elsewhere). All three give the same tokens and logprobs (tests/test_fused_path.py); on an
# H100 (gemma2_decode --parts logits, 1b8b952) the LM head, cap and sampler of Gemma 2 2B's decode steps
# took 0.81 s with "torch", 0.69 with "kernel", 0.67 with "sampler". STEERABLE_FINAL_SOFTCAP overrides
# it for a tuning run.
FINAL_SOFTCAP = os.environ.get("STEERABLE_FINAL_SOFTCAP", "sampler")
if FINAL_SOFTCAP not in ("torch", "kernel", "sampler"):
    raise ValueError(f"STEERABLE_FINAL_SOFTCAP must be torch, kernel or sampler, got {FINAL_SOFTCAP!r}")
# Whether the post-attention norm runs inside the fused residual add + pre-feed-forward norm kernel
# and the post-feed-forward norm inside the next layer's add + input norm (or the final norm's),
# where no hook point needs its output: two kernels a layer fewer, bit for bit the same. The first
# took 0.054 s against 0.086 s as a kernel of its own over Gemma 2 2B's decode steps (H100,
# 1b8b952). STEERABLE_FUSE_POST_NORM=1 / 0 overrides it for a tuning run.
FUSE_POST_NORM = os.environ.get("STEERABLE_FUSE_POST_NORM", "1") == "1"
_DEFAULT_PATTERN = 6  # every sixth layer is global when a config has no layer_types
# Checkpoint prefixes of the multimodal model's text tower (transformers 5, then 4.x) and of what we skip.
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


@dataclass
class Gemma3Config(ModelConfig):
    layer_windows: list[int | None] = field(default_factory=list)  # per layer; None for global layers
    local_rope_theta: float = 10000.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None

    def attention_window(self, layer: int) -> int | None:
        return self.layer_windows[layer]

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5


def layer_types(text: Any, num_layers: int, default_pattern: int = _DEFAULT_PATTERN) -> list[str]:
    """Each layer's attention type: the config's ``layer_types``, or every ``pattern``-th layer global."""
    types = getattr(text, "layer_types", None)
    if types is None:
        pattern = getattr(text, "sliding_window_pattern", None) or default_pattern
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types: unknown attention types {unknown} (expected {SLIDING!r} or {FULL!r})")
    return types


def _rope(text: Any) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta) from transformers 5's per-layer-type
    ``rope_parameters`` or the flat ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict) and FULL in params:
        full = dict(params[FULL] or {})
        local = dict(params.get(SLIDING) or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
    else:
        full = {"rope_theta": getattr(text, "rope_theta", 1_000_000.0),
                **(getattr(text, "rope_scaling", None) or {})}
        local = {"rope_theta": getattr(text, "rope_local_base_freq", 10_000.0)}
    theta, scaling = rope_parameters(SimpleNamespace(rope_parameters=full))
    local_theta, local_scaling = rope_parameters(SimpleNamespace(rope_parameters=local))
    if local_scaling is not None:
        raise ValueError("rope_parameters: scaling of the sliding-attention RoPE is not supported")
    return theta, scaling, local_theta


def gemma3_config(hf: Any) -> Gemma3Config:
    text = getattr(hf, "text_config", None) or hf
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(text, name, None):
            raise ValueError(f"{name}={getattr(text, name)!r} is not supported (causal attention without softcap)")
    activation = getattr(text, "hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={activation!r} is not supported (Gemma 3 uses 'gelu_pytorch_tanh')")
    common = ModelConfig.common(hf)
    types = layer_types(text, common["num_layers"])
    window = getattr(text, "sliding_window", None)
    if SLIDING in types and (window is None or window < 1):
        raise ValueError(f"sliding_window must be >= 1 for sliding-attention layers, got {window!r}")
    theta, scaling, local_theta = _rope(text)
    common.update(rope_theta=theta, rope_scaling=scaling)
    return Gemma3Config(**common, attention_bias=bool(getattr(text, "attention_bias", False)), qk_norm=True,
                        layer_windows=[window if t == SLIDING else None for t in types],
                        local_rope_theta=local_theta,
                        query_pre_attn_scalar=float(getattr(text, "query_pre_attn_scalar", 256)),
                        final_logit_softcapping=getattr(text, "final_logit_softcapping", None))


class Gemma3Attention(LlamaAttention):
    norm_cls = GemmaRMSNorm


class Gemma3MLP(LlamaMLP):
    activation = "gelu_tanh"  # GeGLU with the tanh GELU (HF's gelu_pytorch_tanh)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with Gemma's parts and two more norms: ``post_attention_layernorm`` normalises
    the attention output (HF's names), ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``
    wrap the MLP."""

    norm_cls = GemmaRMSNorm
    attention_cls = Gemma3Attention
    mlp_cls = Gemma3MLP

    def __init__(self, cfg: Gemma3Config, layer: int, hooks: HookPoints, backend: ModuleType,
                 rotary: RotaryEmbedding):
        super().__init__(cfg, layer, hooks, backend, rotary)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, mlp_out: torch.Tensor | None,
                ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer``: the stream entering is ``h + mlp_out``, with ``mlp_out`` the
        previous layer's post-normed MLP output, or a ``PostNormed`` whose norm the entry add + norm
        kernel applies (where no hook point needed ``mlp_out`` there), so the deferred residual adds
        are Gemma's."""
        delta, delta_norm = unpack_delta(mlp_out)
        h, x = self.hooks.residual_norm(self.entry_sites, h, delta, self.input_layernorm, ctx, delta_norm=delta_norm)
        attn = self.self_attn(positions, x, ctx)
        if FUSE_POST_NORM:  # the post-attention norm inside the next add + norm kernel: the same values
            h, x = self.hooks.residual_norm([(POST_ATTN, self.layer)], h, attn, self.pre_feedforward_layernorm, ctx,
                                            delta_norm=self.post_attention_layernorm)
        else:
            h, x = self.hooks.residual_norm([(POST_ATTN, self.layer)], h, self.post_attention_layernorm(attn),
                                            self.pre_feedforward_layernorm, ctx)
        x = self.hooks.mlp_in(self.layer, x, ctx)
        out = self.mlp(x, ctx)
        if FUSE_POST_NORM and fused.enabled(out) and not self.hooks.in_use((MLP_OUT, self.layer), ctx):
            return h, PostNormed(out, self.post_feedforward_layernorm)  # normed inside the next add + norm
        return h, self.hooks.mlp_out(self.layer, self.post_feedforward_layernorm(out), ctx)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Gemma3Config, hooks: HookPoints, backend: ModuleType, max_positions: int):
        super().__init__(cfg, hooks, backend, max_positions)
        # HF multiplies by sqrt(hidden) cast to the weight dtype (25.25, not 25.298, in bfloat16);
        # the weights are built in the default dtype (a later pipeline stage has no embedding).
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.get_default_dtype()))
        self.skipped_tensors = 0

    def make_shared(self, cfg: Gemma3Config, max_positions: int) -> dict[str, RotaryEmbedding]:
        return {"global": RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
                "local": RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta)}

    def make_layer(self, cfg: Gemma3Config, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: dict[str, RotaryEmbedding]) -> nn.Module:
        local = cfg.attention_window(layer) is not None
        return Gemma3DecoderLayer(cfg, layer, hooks, backend, rotary["local" if local else "global"])

    def make_norm(self, cfg: Gemma3Config) -> nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap and logits is not None:  # None: a tensor-parallel rank that does not sample
            if FINAL_SOFTCAP != "torch" and fused.enabled(logits) and logits.is_contiguous():
                return logit_kernels.softcap_(logits, cap)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def logits_for_sampler(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, float | None]:
        cap = self.cfg.final_logit_softcapping
        if cap and FINAL_SOFTCAP == "sampler":
            return super().compute_logits(hidden), cap
        return self.compute_logits(hidden), None

    def map_name(self, name: str) -> str | None:
        """The multimodal checkpoint's text tower loads under our names; vision weights are skipped."""
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        if name.startswith(_VISION_PREFIXES):
            self.skipped_tensors += 1
            return None
        return super().map_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        if self.skipped_tensors:
            logger.info("Gemma 3: loaded the text tower; skipped %d vision-tower and projector tensors",
                        self.skipped_tensors)
