"""Qwen3-MoE: the Qwen3 decoder (q/k norm) with a sparse mixture-of-experts MLP on most layers.

Everything but the MLP is the Llama-family implementation. A layer is sparse unless it is listed
in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step != 0`` (HF's rule); dense layers use
the ordinary ``LlamaMLP`` with ``intermediate_size``. The sparse block places the
``router_logits`` hook point on the gate output, before softmax and top-k.

Checkpoints: per-expert tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what HF writes,
transformers 4.x and 5.x alike) and the fused 3-D ``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj`` (transformers 5.x in-memory layout) both load into our fused parameters.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steerable.config import ModelConfig
from steerable.hook_points import ROUTER_LOGITS, HookPoints
from steerable.layers.activation import silu_and_mul
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    """HF's rule for which decoder layers get the sparse MoE block."""
    hf = cfg.hf_config
    mlp_only = getattr(hf, "mlp_only_layers", None) or []
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return layer not in mlp_only and cfg.num_experts > 0 and (layer + 1) % step == 0


class Qwen3MoeSparseBlock(nn.Module):
    """Top-k routed SwiGLU experts. Expert weights are stored fused:
    ``experts_gate_up [E, 2*I, H]`` (gate rows then up rows per expert) and ``experts_down [E, H, I]``."""

    def __init__(self, cfg: ModelConfig, layer: int, hooks: HookPoints):
        super().__init__()
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts={cfg.num_experts}")
        self.layer = layer
        self.hooks = hooks
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.intermediate_size = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size))

    def route(self, x: torch.Tensor, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their weights [T, k] (in the activation dtype, as HF)."""
        router_logits = self.gate(x)  # [T, E]
        self.hooks.observe(ROUTER_LOGITS, self.layer, router_logits, batch)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(router_logits.dtype)

    def forward(self, x: torch.Tensor, batch: Any = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x, batch)
        num_tokens, k = experts.shape
        # Group the T*k (token, expert) assignments by expert: one host sync for the group sizes.
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[token_of]
        ws = weights.reshape(-1)[order]
        ys = torch.empty_like(xs)
        # A grouped GEMM (one kernel over all expert segments, no host sync) replaces this loop on GPU.
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            h = silu_and_mul(F.linear(xs[seg], self.experts_gate_up[e]))
            ys[seg] = F.linear(h, self.experts_down[e]) * ws[seg, None]
            start += n
        # Back to (token, slot) order and sum the k expert outputs of each token: deterministic and
        # independent of which other tokens share the batch.
        out = torch.empty_like(ys)
        out[order] = ys
        return out.view(num_tokens, k, -1).sum(dim=1).reshape(shape)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    supports_cuda_graphs = False  # expert dispatch reads group sizes on the host
    _EXPERT_PARAMS = ("experts_gate_up", "experts_down")

    def make_layer(self, cfg: ModelConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        if is_sparse_layer(cfg, layer):
            mlp: nn.Module = Qwen3MoeSparseBlock(cfg, layer, hooks)
        else:
            mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        return LlamaDecoderLayer(cfg, layer, hooks, backend, rotary, mlp=mlp)

    def router_layers(self) -> list[int]:
        """Layers whose sparse block reports router logits (the dense ``mlp_only`` ones do not)."""
        return [i for i in range(self.cfg.num_layers) if is_sparse_layer(self.cfg, i)]

    def num_shards(self, name: str) -> int:
        """How many checkpoint tensors fill our parameter ``name``."""
        leaf = name.split(".")[-1]
        if leaf == "experts_gate_up":
            return 2 * self.cfg.num_experts
        if leaf == "experts_down":
            return self.cfg.num_experts
        return super().num_shards(name)

    def shard_view(self, name: str, param: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The part of ``param`` that checkpoint shard ``shard`` fills (all of it for None)."""
        if shard is None:
            return param
        leaf = name.split(".")[-1]
        if leaf == "experts_gate_up":
            size = self.cfg.moe_intermediate_size
            return param[shard // 2].narrow(0, (shard % 2) * size, size)
        if leaf == "experts_down":
            return param[shard]
        return super().shard_view(name, param, shard)

    def locate(self, name: str) -> tuple[str, int | None]:
        parts = name.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            prefix = ".".join(parts[:i])
            rest = parts[i + 1:]
            if len(rest) == 1 and rest[0] in ("gate_up_proj", "down_proj"):  # fused 3-D tensor
                return f"{prefix}.experts_{'gate_up' if rest[0] == 'gate_up_proj' else 'down'}", None
            if len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight":  # experts.{e}.{proj}.weight
                e = int(rest[0])
                if e >= self.cfg.num_experts:
                    raise ValueError(f"checkpoint tensor {name!r}: expert {e} >= num_experts={self.cfg.num_experts}")
                if rest[1] in ("gate_proj", "up_proj"):
                    return f"{prefix}.experts_gate_up", 2 * e + (rest[1] == "up_proj")
                if rest[1] == "down_proj":
                    return f"{prefix}.experts_down", e
            raise ValueError(f"checkpoint tensor {name!r}: unrecognised expert weight name")
        return super().locate(name)
