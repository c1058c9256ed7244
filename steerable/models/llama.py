"""Llama-family decoder: Llama 2/3 (llama3 RoPE scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model only places hook points; steering and capture act there through ``HookPoints``.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import ATTENTION_HEADS, POST_ATTN, POST_MLP, PRE_ATTN, HookPoints
from steerable.layers.activation import silu_and_mul
from steerable.layers import fused
from steerable.layers.attention import Attention
from steerable.layers.norm import RMSNorm
from steerable.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType, rotary: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.head_dim = cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                              cfg.sliding_window, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: Any) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if fused.enabled(qkv):
            norm = self.q_norm is not None
            q, k, v = fused.qk_norm_rope(qkv, positions, self.rotary.cos, self.rotary.sin, self.attn.num_heads,
                                         self.attn.num_kv_heads, self.head_dim, self.q_norm.weight if norm else None,
                                         self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0,
                                         kv_cache=self.attn.cache_slots(batch))
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(-1, self.q_size // self.head_dim, self.head_dim)
            k = k.reshape(-1, self.kv_size // self.head_dim, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        heads = self.attn(q, k, v, batch)
        self.hooks.observe(ATTENTION_HEADS, self.layer, heads, batch)
        return self.o_proj(heads)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: Any = None) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                 rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, hooks, backend, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        # The previous layer's output is formed here, inside this layer's first norm.
        self.entry_sites = [(POST_MLP, layer - 1)] * (layer > 0) + [(PRE_ATTN, layer)]

    def forward(self, positions: torch.Tensor, h: torch.Tensor, mlp_out: torch.Tensor | None,
                batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual adds are deferred into the following norm: the stream entering this layer is
        ``h + mlp_out`` (the previous layer's MLP output, None for layer 0), and this layer returns
        its own ``(h, mlp_out)``."""
        h, x = self.hooks.residual_norm(self.entry_sites, h, mlp_out, self.input_layernorm, batch)
        attn_out = self.self_attn(positions, x, batch)
        h, x = self.hooks.residual_norm([(POST_ATTN, self.layer)], h, attn_out, self.post_attention_layernorm, batch)
        return h, self.mlp(x, batch)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names that load into a slice of one of our fused parameters.
    stacked_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, hooks: HookPoints, backend: ModuleType, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.hooks = hooks
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, hooks, backend, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_layer(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer, hooks, backend, rotary)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """Final-normed hidden states of every row; logits are computed only for sampled rows."""
        h, mlp_out = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, mlp_out = layer(positions, h, mlp_out, batch)
        return self.hooks.residual_norm([(POST_MLP, len(self.layers) - 1)], h, mlp_out, self.norm, batch)[1]

    def router_layers(self) -> list[int]:
        """Layers whose hook points report MoE router logits (none for dense models)."""
        return []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype, as HF computes them; the sampler upcasts where it needs to."""
        return F.linear(hidden, self.lm_head.weight)

    def shard_sizes(self, module: str) -> list[int] | None:
        """Row sizes of the checkpoint tensors stacked into a fused module's weight (None: not fused)."""
        cfg = self.cfg
        if module == "qkv_proj":
            kv = cfg.num_kv_heads * cfg.head_dim
            return [cfg.num_heads * cfg.head_dim, kv, kv]
        if module == "gate_up_proj":
            return [cfg.intermediate_size] * 2
        return None

    def num_shards(self, name: str) -> int:
        """How many checkpoint tensors fill our parameter ``name``."""
        return len(self.shard_sizes(name.split(".")[-2]) or [None])

    def shard_view(self, name: str, param: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The part of ``param`` that checkpoint shard ``shard`` fills (all of it for None)."""
        if shard is None:
            return param
        sizes = self.shard_sizes(name.split(".")[-2])
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def locate(self, name: str) -> tuple[str, int | None]:
        """Our parameter name for an HF tensor name, and the shard of a fused parameter it fills."""
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.stacked_params:
                fused, shard = self.stacked_params[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, stacking shards (q/k/v, gate/up, experts) into fused parameters;
        every parameter, and every shard of a fused one, must be filled from the checkpoint."""
        params = dict(self.named_parameters())
        expected = {(name, s) for name in params for s in range(self.num_shards(name))}
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            name = self.map_name(hf_name)
            if name is None:
                continue
            target, shard = self.locate(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            dest = self.shard_view(target, params[target].data, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.update((target, s) for s in (range(self.num_shards(target)) if shard is None else [shard]))
        missing = sorted({name for name, _ in expected - loaded})
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")

    def map_name(self, name: str) -> str | None:
        """HF name -> our name; None skips tensors we do not keep (rotary caches, a tied lm_head)."""
        if "rotary_emb" in name:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        return name
