"""GPT-NeoX and Pythia (HF ``GPTNeoXForCausalLM``): LayerNorms with biases, a fused qkv projection
whose rows are interleaved per head, rotary embeddings on the first ``rotary_pct`` of each head's
dimensions only, an ungated GELU MLP, an untied head (``embed_out``) by default.

With ``use_parallel_residual`` (Pythia's default) attention and MLP both read the layer input:
``out = x + attn(ln1(x)) + mlp(ln2(x))``. Hook points keep their meaning: ``pre_attn`` is ``x``,
``post_mlp`` the layer output, and ``post_attn`` is defined as ``x + attn(ln1(x))``, the residual
after the attention add and before the MLP's output is added. Steering there changes the residual
(and so the layer output) but not this layer's MLP input, which is ``ln2(x)`` (``mlp_in``). Without
the flag the layer is the sequential pre-norm layer of Llama and GPT-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import ATTENTION_HEADS, POST_ATTN, HookPoints
from steerable.layers.attention import Attention
from steerable.layers.linear import HeadInterleavedQKVLinear, RowLinear
from steerable.layers.norm import LayerNorm
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.base import CausalLM
from steerable.models.gpt2 import UngatedMLP
from steerable.models.llama import LlamaDecoderLayer

_SKIPPED = (".attention.bias", ".attention.masked_bias")  # causal-mask buffers of older checkpoints
_NAMES = {"attention.query_key_value": "self_attn.qkv_proj", "attention.dense": "self_attn.o_proj",
          "mlp.dense_h_to_4h": "mlp.up_proj", "mlp.dense_4h_to_h": "mlp.down_proj"}


@dataclass
class GPTNeoXConfig(ModelConfig):
    hidden_act: str = "gelu"
    rotary_dim: int = 0  # the leading dimensions of each head that RoPE rotates
    use_parallel_residual: bool = True


def _partial_rotary_factor(hf: Any) -> float:
    """transformers 5 keeps it in ``rope_parameters``; 4.x configs have ``rotary_pct``."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(hf, "rotary_pct", 1.0))


def gpt_neox_config(hf: Any) -> GPTNeoXConfig:
    common = ModelConfig.common(hf, eps_name="layer_norm_eps")
    hidden, heads = common["hidden_size"], common["num_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads})")
    head_dim = hidden // heads
    factor = _partial_rotary_factor(hf)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"rotary_pct={factor!r} gives {rotary_dim} rotary dimensions of {head_dim}; "
                         "expected an even number >= 2")
    common.update(num_kv_heads=heads, head_dim=head_dim)
    return GPTNeoXConfig(**common, attention_bias=bool(getattr(hf, "attention_bias", True)),
                         hidden_act=getattr(hf, "hidden_act", "gelu"), rotary_dim=rotary_dim,
                         use_parallel_residual=bool(getattr(hf, "use_parallel_residual", True)))


class GPTNeoXAttention(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.qkv_proj = HeadInterleavedQKVLinear(cfg.hidden_size, cfg.num_heads, cfg.head_dim, bias=cfg.attention_bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.rotary = rotary
        self.o_proj = RowLinear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.attn = Attention(self.num_heads, self.num_heads, cfg.head_dim, cfg.attention_scale, None, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim] * 3, dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_heads, self.head_dim)
        rot = self.rotary_dim
        q_rot, k_rot = self.rotary(positions, q[..., :rot], k[..., :rot])
        q = torch.cat((q_rot, q[..., rot:]), dim=-1)
        k = torch.cat((k_rot, k[..., rot:]), dim=-1)
        heads = self.attn(q, k, v, ctx)
        self.hooks.attention_patterns(self.layer, q, self.attn, ctx)
        self.hooks.observe(ATTENTION_HEADS, self.layer, heads, ctx)
        return self.o_proj(heads)


class GPTNeoXLayer(LlamaDecoderLayer):
    """Llama's layer with NeoX's parts; the parallel residual reads both branches off the input."""

    norm_cls = LayerNorm
    attention_cls = GPTNeoXAttention

    def __init__(self, cfg: GPTNeoXConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                 rotary: RotaryEmbedding):
        mlp = UngatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, "hidden_act")
        super().__init__(cfg, layer, hooks, backend, rotary, mlp=mlp)
        self.parallel = cfg.use_parallel_residual

    def forward(self, positions: torch.Tensor, h: torch.Tensor, mlp_out: torch.Tensor | None,
                ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.parallel:
            return super().forward(positions, h, mlp_out, ctx)
        h, x = self.hooks.residual_norm(self.entry_sites, h, mlp_out, self.input_layernorm, ctx)
        attn_out = self.self_attn(positions, x, ctx)
        written = None
        if self.hooks.in_use((POST_ATTN, self.layer), ctx):
            # Formed before the MLP's points, which may write what a read here decided (a
            # transcoder clamp reading hook_resid_mid). Only what steering wrote here joins the
            # stream: rows it left alone keep HF's sum bit for bit, whatever their batch company does.
            post = h + attn_out
            written = self.hooks.residual(POST_ATTN, self.layer, post, ctx) - post
        x = self.hooks.mlp_in(self.layer, self.post_attention_layernorm(h), ctx)
        mlp_out = self.hooks.mlp_out(self.layer, self.mlp(x, ctx), ctx)
        delta = mlp_out + attn_out  # HF's sum, (mlp + attn) + x; the next norm adds x
        return h, delta if written is None else delta + written


class GPTNeoXForCausalLM(CausalLM):
    def make_shared(self, cfg: GPTNeoXConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)

    def make_layer(self, cfg: GPTNeoXConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        return GPTNeoXLayer(cfg, layer, hooks, backend, rotary)

    def make_norm(self, cfg: GPTNeoXConfig) -> nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def map_name(self, name: str) -> str | None:
        if name.endswith(_SKIPPED) or "rotary_emb" in name:
            return None
        if name == "embed_out.weight":
            return None if self.cfg.tie_word_embeddings else "lm_head.weight"
        if name.startswith("gpt_neox."):
            name = name[len("gpt_neox."):]
        if name.startswith("embed_in."):
            return "embed_tokens." + name[len("embed_in."):]
        if name.startswith("final_layer_norm."):
            return "norm." + name[len("final_layer_norm."):]
        for theirs, ours in _NAMES.items():
            name = name.replace(f".{theirs}.", f".{ours}.")
        return name
