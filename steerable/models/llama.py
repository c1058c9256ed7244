"""Llama-family decoder: Llama 2/3 (llama3 RoPE scaling), Mistral (sliding window), Qwen2 (qkv
bias), Qwen3 (q/k norm). One config adapter per HF family, all building the same layer.

The model only places hook points; steering and capture act there through ``HookPoints``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import ATTENTION_HEADS, POST_ATTN, POST_MLP, PRE_ATTN, HookPoints
from steerable.layers import fused, gemv
from steerable.layers.attention import Attention
from steerable.layers.linear import MergedLinear, QKVLinear, RowLinear
from steerable.layers.norm import RMSNorm
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.base import CausalLM

# ---------------------------------------------------------------- config adapters


def llama_config(hf: Any) -> ModelConfig:
    return ModelConfig(**ModelConfig.common(hf), attention_bias=bool(getattr(hf, "attention_bias", False)))


def mistral_config(hf: Any) -> ModelConfig:
    return ModelConfig(**ModelConfig.common(hf), sliding_window=getattr(hf, "sliding_window", None))


def _qwen_window(hf: Any) -> int | None:
    return getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", False) else None


def qwen2_config(hf: Any) -> ModelConfig:
    return ModelConfig(**ModelConfig.common(hf), attention_bias=True, sliding_window=_qwen_window(hf))


def qwen3_config(hf: Any) -> ModelConfig:
    return ModelConfig(**ModelConfig.common(hf), attention_bias=bool(getattr(hf, "attention_bias", False)),
                       qk_norm=True, sliding_window=_qwen_window(hf))


# ---------------------------------------------------------------- the layer


class LlamaAttention(nn.Module):
    norm_cls: type[RMSNorm] = RMSNorm  # the per-head q/k norm, when the config has one

    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType, rotary: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        # Heads split over the tensor-parallel ranks: the sizes below are this rank's.
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  bias=cfg.attention_bias)
        self.q_size = self.qkv_proj.num_heads * cfg.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * cfg.head_dim
        self.o_proj = RowLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.head_dim = cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = self.norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim, cfg.attention_scale,
                              cfg.attention_window(layer), backend, softcap=cfg.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if fused.enabled(qkv):
            norm = self.q_norm is not None
            q, k, v = fused.qk_norm_rope(qkv, positions, self.rotary.cos, self.rotary.sin, self.attn.num_heads,
                                         self.attn.num_kv_heads, self.head_dim, self.q_norm.weight if norm else None,
                                         self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                                         kv_cache=self.attn.cache_slots(ctx), unit_offset=self.norm_cls.unit_offset)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, self.q_size // self.head_dim, self.head_dim)
            k = k.reshape(-1, self.kv_size // self.head_dim, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        heads = self.attn(q, k, v, ctx)
        self.hooks.attention_patterns(self.layer, q, self.attn, ctx)
        self.hooks.observe(ATTENTION_HEADS, self.layer, heads, ctx)
        return self.o_proj(heads)


class LlamaMLP(nn.Module):
    activation = "silu"  # SwiGLU; the down projection applies it (see RowLinear)

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        outs = [self.down_proj(self.gate_up_proj(part), gated=self.activation)
                for part in gemv.cpu_row_chunks(x, self.down_proj.weight)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class LlamaDecoderLayer(nn.Module):
    # What a family with this layer's shape swaps in (Gemma 3).
    norm_cls: type[RMSNorm] = RMSNorm
    attention_cls: type[LlamaAttention] = LlamaAttention
    mlp_cls: type[LlamaMLP] = LlamaMLP

    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                 rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.input_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer, hooks, backend, rotary)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else self.mlp_cls(cfg.hidden_size, cfg.intermediate_size)
        # The previous layer's output is formed here, inside this layer's first norm.
        self.entry_sites = [(POST_MLP, layer - 1)] * (layer > 0) + [(PRE_ATTN, layer)]

    def forward(self, positions: torch.Tensor, h: torch.Tensor, mlp_out: torch.Tensor | None,
                ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream entering this layer is ``h + mlp_out`` (the previous layer's MLP output, None
        for layer 0); this layer returns its own ``(h, mlp_out)``."""
        h, x = self.hooks.residual_norm(self.entry_sites, h, mlp_out, self.input_layernorm, ctx)
        attn_out = self.self_attn(positions, x, ctx)
        h, x = self.hooks.residual_norm([(POST_ATTN, self.layer)], h, attn_out, self.post_attention_layernorm, ctx)
        x = self.hooks.mlp_in(self.layer, x, ctx)
        return h, self.hooks.mlp_out(self.layer, self.mlp(x, ctx), ctx)


class LlamaForCausalLM(CausalLM):
    stacked_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def make_shared(self, cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer, hooks, backend, rotary)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
