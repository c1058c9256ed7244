"""OLMo-2: HF ``Olmo2ForCausalLM``. Llama's projections and SwiGLU MLP, but the norms come after
each block instead of before it: ``h = x + post_attention_layernorm(attn(x))``, ``out = h +
post_feedforward_layernorm(mlp(h))``, so attention and MLP read the raw residual stream; and q/k are
RMS-normed over the whole projection (all heads together) before RoPE.

That q/k norm is not the per-head one the fused ``qk_norm_rope`` kernel does, so OLMo-2's q/k norm
and RoPE run in PyTorch on every device (the rest of the layer uses the fused kernels). Under
tensor parallelism a rank holds some heads' columns: the sum of squares is all-reduced over the
ranks before the division, so every rank normalises by the full projection's RMS.

Hook points mean what they mean for every model: ``pre_attn`` is the layer input, which here is
also what attention reads; ``post_attn`` the residual after the (post-normed) attention add;
``mlp_in`` what the MLP reads, the raw stream at ``post_attn`` (a write there changes only the
MLP's input); ``mlp_out`` the post-feed-forward norm's output.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.config import ModelConfig
from steerable.distributed.groups import current_tp
from steerable.hook_points import ATTENTION_HEADS, POST_ATTN, POST_MLP, PRE_ATTN, HookPoints
from steerable.layers.linear import Weight, check_shape, default_weight_loader, kv_head_shard
from steerable.layers.norm import PassThrough, RMSNorm
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def olmo2_config(hf: Any) -> ModelConfig:
    activation = getattr(hf, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(f"hidden_act={activation!r} is not supported (OLMo-2 uses 'silu')")
    return ModelConfig(**ModelConfig.common(hf), attention_bias=bool(getattr(hf, "attention_bias", False)))


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection whose columns ``[start, start + size)`` of
    ``full_size`` live on this rank; ``copies``: how many ranks hold each column (replicated KV
    heads), which the all-reduced sum of squares counts that many times."""

    def __init__(self, full_size: int, start: int, size: int, copies: int, eps: float):
        super().__init__()
        self.tp = current_tp()
        self.full_size, self.start, self.copies, self.eps = full_size, start, copies, eps
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        check_shape(tensor, [self.full_size])
        default_weight_loader(param, tensor.narrow(0, self.start, param.shape[0]), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.size == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / (self.full_size * self.copies)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType, rotary: RotaryEmbedding):
        super().__init__(cfg, layer, hooks, backend, rotary)
        tp = current_tp()
        d = cfg.head_dim
        q_start = tp.rank * self.qkv_proj.num_heads
        kv_start, kv_count = kv_head_shard(cfg.num_kv_heads, tp)
        kv_copies = max(1, tp.size // cfg.num_kv_heads)
        self.q_norm = ProjectionRMSNorm(cfg.num_heads * d, q_start * d, self.q_size, 1, cfg.rms_norm_eps)
        self.k_norm = ProjectionRMSNorm(cfg.num_kv_heads * d, kv_start * d, kv_count * d, kv_copies, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(-1, self.q_size // self.head_dim, self.head_dim)
        k = self.k_norm(k).reshape(-1, self.kv_size // self.head_dim, self.head_dim)
        q, k = self.rotary(positions, q, k)
        heads = self.attn(q, k, v, ctx)
        self.hooks.attention_patterns(self.layer, q, self.attn, ctx)
        self.hooks.observe(ATTENTION_HEADS, self.layer, heads, ctx)
        return self.o_proj(heads)


_RAW = PassThrough()  # attention and MLP read the stream itself


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType, rotary: RotaryEmbedding):
        super().__init__()
        self.layer = layer
        self.hooks = hooks
        self.self_attn = Olmo2Attention(cfg, layer, hooks, backend, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.entry_sites = [(POST_MLP, layer - 1)] * (layer > 0) + [(PRE_ATTN, layer)]

    def forward(self, positions: torch.Tensor, h: torch.Tensor, mlp_out: torch.Tensor | None,
                ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer``: the stream entering is ``h + mlp_out``; the branch outputs
        handed on are already post-normed."""
        h, _ = self.hooks.residual_norm(self.entry_sites, h, mlp_out, _RAW, ctx)
        attn_out = self.post_attention_layernorm(self.self_attn(positions, h, ctx))
        h, _ = self.hooks.residual_norm([(POST_ATTN, self.layer)], h, attn_out, _RAW, ctx)
        x = self.hooks.mlp_in(self.layer, h, ctx)  # the raw stream; a write here reaches only the MLP
        return h, self.hooks.mlp_out(self.layer, self.post_feedforward_layernorm(self.mlp(x, ctx)), ctx)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        return Olmo2DecoderLayer(cfg, layer, hooks, backend, rotary)
