"""GPT-2 (HF ``GPT2LMHeadModel``): learned absolute position embeddings added to the token
embedding, pre-LayerNorm blocks with biases everywhere, one fused ``c_attn`` projection (q | k | v),
an ungated MLP with GPT-2's tanh GELU (``gelu_new``), and a head tied to the token embedding.

HF keeps the projections as ``Conv1D`` modules whose weights are stored ``[in, out]``; they load
transposed (without being read first: see ``CheckpointTensor.t``) into the engine's linear layers,
so tensor parallelism splits them like any other. Checkpoints name tensors with or without the
``transformer.`` prefix (OpenAI's original files have none).

Hook points mean what they mean for every model: ``pre_attn`` is the block input (token plus
position embedding at layer 0), ``post_attn`` the residual after the attention add.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import ATTENTION_HEADS, HookPoints
from steerable.layers.activation import activation
from steerable.layers.attention import Attention
from steerable.layers.linear import MergedLinear, QKVLinear, RowLinear, Weight
from steerable.layers.norm import LayerNorm
from steerable.models.base import CausalLM
from steerable.models.llama import LlamaDecoderLayer


@dataclass
class GPT2Config(ModelConfig):
    hidden_act: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False

    def layer_attention_scale(self, layer: int) -> float:
        """HF's scale: ``head_dim ** -0.5`` (unless ``scale_attn_weights`` is off), divided by
        ``layer + 1`` with ``scale_attn_by_inverse_layer_idx``."""
        scale = self.head_dim ** -0.5 if self.scale_attn_weights else 1.0
        return scale / (layer + 1) if self.scale_attn_by_inverse_layer_idx else scale


def gpt2_config(hf: Any) -> GPT2Config:
    if getattr(hf, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True is not supported (decoder-only GPT-2)")
    common = ModelConfig.common(hf, eps_name="layer_norm_epsilon")
    hidden, heads = common["hidden_size"], common["num_heads"]
    if hidden % heads:
        raise ValueError(f"n_embd ({hidden}) is not a multiple of n_head ({heads})")
    act = getattr(hf, "activation_function", "gelu_new")
    activation(act, "activation_function")  # refused here, before anything is allocated
    common.update(num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=getattr(hf, "n_inner", None)
                  or 4 * hidden, rope_scaling=None)
    return GPT2Config(**common, attention_bias=True, hidden_act=act,
                      scale_attn_weights=bool(getattr(hf, "scale_attn_weights", True)),
                      scale_attn_by_inverse_layer_idx=bool(getattr(hf, "scale_attn_by_inverse_layer_idx", False)))


class UngatedMLP(nn.Module):
    """``down(act(up(x)))`` with biases (GPT-2's ``c_fc`` / ``c_proj``, GPT-NeoX's ``dense_h_to_4h`` /
    ``dense_4h_to_h``): column-parallel up, row-parallel down."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, field: str):
        super().__init__()
        self.up_proj = MergedLinear(hidden_size, [intermediate_size], bias=True)
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=True)
        self.act = activation(act, field)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GPT2Attention(nn.Module):
    """Multi-head attention without rotary embeddings (positions entered with the embedding)."""

    def __init__(self, cfg: GPT2Config, layer: int, hooks: HookPoints, backend: ModuleType, rotary: None = None):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_heads, cfg.head_dim, bias=True)
        self.size = self.qkv_proj.num_heads * cfg.head_dim  # this rank's heads
        self.o_proj = RowLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_heads, cfg.head_dim,
                              cfg.layer_attention_scale(layer), None, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.size] * 3, dim=-1)
        heads = self.attn(q, k, v, ctx)
        self.hooks.attention_patterns(self.layer, q, self.attn, ctx)
        self.hooks.observe(ATTENTION_HEADS, self.layer, heads, ctx)
        return self.o_proj(heads)


class GPT2Block(LlamaDecoderLayer):
    """Llama's pre-norm layer (deferred residual adds, hook placement) with GPT-2's parts."""

    norm_cls = LayerNorm
    attention_cls = GPT2Attention


# HF names inside a block -> ours (the names LlamaDecoderLayer gives its parts).
_BLOCK_NAMES = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_attn": "self_attn.qkv_proj",
                "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_TOP_NAMES = {"wte": "embed_tokens", "wpe": "embed_positions", "ln_f": "norm"}
_BLOCK_RE = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")
_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2LMHeadModel(CausalLM):
    def __init__(self, cfg: GPT2Config, hooks: HookPoints, backend: ModuleType, max_positions: int):
        super().__init__(cfg, hooks, backend, max_positions)
        # Replicated on every tensor-parallel rank (positions x hidden is small); first stage only.
        self.embed_positions = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                if self.placement.is_first_stage else None)

    def make_layer(self, cfg: GPT2Config, layer: int, hooks: HookPoints, backend: ModuleType,
                   shared: None) -> nn.Module:
        mlp = UngatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, "activation_function")
        return GPT2Block(cfg, layer, hooks, backend, None, mlp=mlp)

    def make_norm(self, cfg: GPT2Config) -> nn.Module:
        return LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed_at(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) + self.embed_positions(positions)

    def map_name(self, name: str) -> str | None:
        if name.startswith("transformer."):
            name = name[len("transformer."):]
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of older checkpoints
            return None
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else name
        top, _, param = name.partition(".")
        if top in _TOP_NAMES:
            return f"{_TOP_NAMES[top]}.{param}"
        m = _BLOCK_RE.fullmatch(name)
        if m and m.group(2) in _BLOCK_NAMES:
            return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
        return name  # unknown: load_weights reports it

    def on_stage(self, name: str) -> str | None:
        if name.startswith("embed_positions.") and self.embed_positions is None:
            return None
        return super().on_stage(name)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """HF's ``Conv1D`` weights are ``[in, out]``: each loads as its transpose."""
        super().load_weights((name, tensor.t() if name.endswith(_CONV1D) else tensor) for name, tensor in weights)
