"""Qwen3-MoE: the Qwen3 decoder (q/k norm) with a sparse mixture-of-experts MLP on most layers.

Everything but the MLP is the Llama-family implementation. A layer is sparse unless it is listed
in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step != 0`` (HF's rule); dense layers use
the ordinary ``LlamaMLP`` with ``intermediate_size``. The sparse block places the
``router_logits`` hook point on the gate output, before softmax and top-k; the layer's ``mlp_out``
is the block's output, the weighted sum of the chosen experts' outputs.

Checkpoints: per-expert tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what HF writes,
transformers 4.x and 5.x alike) and the fused 3-D ``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj`` (transformers 5.x in-memory layout) both load into our fused parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from steerable.config import ModelConfig
from steerable.distributed.groups import current_tp
from steerable.hook_points import ROUTER_LOGITS, HookLayout, HookPoints
from steerable.layers import fused, gemv
from steerable.layers.activation import silu_and_mul
from steerable.layers.fused_moe import fused_moe
from steerable.layers.linear import Weight, check_shape, default_weight_loader, even_shard
from steerable.layers.moe_routing import route_topk, route_topk_reference
from steerable.layers.rotary import RotaryEmbedding
from steerable.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, qwen3_config


@dataclass
class MoeConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

    def is_sparse_layer(self, layer: int) -> bool:
        """HF's rule for which decoder layers get the sparse MoE block."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def router_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_sparse_layer(i)]

    def multiply_adds_per_token(self) -> int:
        """A sparse layer's token passes through its routed experts, not a dense MLP."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        routed = 3 * self.hidden_size * self.moe_intermediate_size * self.num_experts_per_tok
        return super().multiply_adds_per_token() + len(self.router_layers) * (routed - dense_mlp)


def qwen3_moe_config(hf: Any) -> MoeConfig:
    base = vars(qwen3_config(hf))
    return MoeConfig(**base, num_experts=getattr(hf, "num_experts", 0) or 0,
                     num_experts_per_tok=getattr(hf, "num_experts_per_tok", 0) or 0,
                     moe_intermediate_size=getattr(hf, "moe_intermediate_size", 0) or 0,
                     norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),
                     mlp_only_layers=list(getattr(hf, "mlp_only_layers", None) or []),
                     decoder_sparse_step=getattr(hf, "decoder_sparse_step", 1) or 1)


class Qwen3MoeSparseBlock(nn.Module):
    """Top-k routed SwiGLU experts. Expert weights are stored fused:
    ``experts_gate_up [E, 2*I, H]`` (gate rows then up rows per expert) and ``experts_down [E, H, I]``.

    Under tensor parallelism the experts are split over the ranks (rank r holds experts
    ``[r E/T, (r+1) E/T)`` whole, and reads only their tensors); the router is replicated, every
    rank computes its experts' share of each token and one all-reduce sums the shares. Splitting
    each expert's intermediate dimension instead would keep every rank looping over all experts,
    which is where this host-side dispatch spends its time (``docs/parallel.md`` has the numbers).
    """

    def __init__(self, cfg: MoeConfig, layer: int, hooks: HookPoints):
        super().__init__()
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts={cfg.num_experts}")
        self.layer = layer
        self.hooks = hooks
        self.tp = current_tp()
        self.num_experts = cfg.num_experts
        self.first_expert, local = even_shard(cfg.num_experts, self.tp, "num_experts")
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.intermediate_size = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(local, 2 * cfg.moe_intermediate_size, cfg.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(local, cfg.hidden_size, cfg.moe_intermediate_size))
        # Checkpoint shards: gate_up holds (expert e, gate | up) as shard 2e | 2e + 1; down holds expert e.
        self.experts_gate_up.weight_loader, self.experts_gate_up.num_shards = self._load_gate_up, 2 * cfg.num_experts
        self.experts_down.weight_loader, self.experts_down.num_shards = self._load_down, cfg.num_experts

    def _local(self, expert: int) -> int | None:
        """This rank's index of a global expert id (None: another rank's)."""
        index = expert - self.first_expert
        return index if 0 <= index < self.experts_down.shape[0] else None

    def _stacked(self, param: torch.Tensor, tensor: Weight) -> None:
        """A fused 3-D checkpoint tensor holding every expert: read this rank's experts only."""
        check_shape(tensor, [self.num_experts, *param.shape[1:]])
        default_weight_loader(param, tensor.narrow(0, self.first_expert, param.shape[0]), None)

    def _load_gate_up(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        if shard is None:
            self._stacked(param, tensor)
            return
        local = self._local(shard // 2)
        if local is not None:
            size = self.intermediate_size
            default_weight_loader(param.data[local].narrow(0, (shard % 2) * size, size), tensor, None)

    def _load_down(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        if shard is None:
            self._stacked(param, tensor)
            return
        local = self._local(shard)
        if local is not None:
            default_weight_loader(param.data[local], tensor, None)

    def route(self, x: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their weights [T, k] (in the activation dtype, as HF)."""
        router_logits = gemv.linear(x, self.gate.weight)  # [T, E]; one row (batch-1 decode): the GEMV kernel
        router_logits = self.hooks.steered(ROUTER_LOGITS, self.layer, router_logits, ctx)
        if fused.enabled(x):  # one kernel instead of 6, the weights stored in the activation dtype
            return route_topk(router_logits, self.top_k, self.norm_topk_prob, router_logits.dtype)
        experts, weights = route_topk_reference(router_logits, self.top_k, self.norm_topk_prob)
        return experts, weights.to(router_logits.dtype)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x, ctx)
        num_tokens, k = experts.shape
        # Each token's sum of its k expert outputs: deterministic and independent of which other
        # tokens share the batch; under tensor parallelism each rank holds its experts' share.
        if fused.enabled(x):  # static shapes: no host sync, CUDA-graph safe; a 16-bit token: two GEMVs
            out = fused_moe(x, *self._local_assignments(experts, weights), self.experts_gate_up, self.experts_down)
        else:
            out = self._experts_loop(x, experts, weights).view(num_tokens, k, -1).sum(dim=1)
        return self.tp.all_reduce(out).reshape(shape)

    def _local_assignments(self, experts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids in this rank's numbering; another rank's assignments go to expert 0 with
        weight 0, so they add exact zeros here (static shapes: no host sync to drop them)."""
        local = self.experts_down.shape[0]
        if local == self.num_experts:
            return experts, weights
        ids = experts - self.first_expert
        mine = (ids >= 0) & (ids < local)
        return torch.where(mine, ids, 0), torch.where(mine, weights, torch.zeros_like(weights))

    def _experts_loop(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The PyTorch path (and the reference): assignments grouped by expert with one host sync
        for the group sizes, one pair of linears per expert; outputs in assignment order."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[token_of]
        ws = weights.reshape(-1)[order]
        local = self.experts_down.shape[0]
        # Assignments to another rank's experts contribute zeros here (that rank adds them).
        ys = torch.empty_like(xs) if local == self.num_experts else torch.zeros_like(xs)
        start = sum(counts[:self.first_expert])
        for e in range(local):
            n = counts[self.first_expert + e]
            if n == 0:
                continue
            seg = slice(start, start + n)
            h = silu_and_mul(F.linear(xs[seg], self.experts_gate_up[e]))
            ys[seg] = F.linear(h, self.experts_down[e]) * ws[seg, None]
            start += n
        out = torch.empty_like(ys)
        out[order] = ys
        return out


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, cfg: MoeConfig, layer: int, hooks: HookPoints, backend: ModuleType,
                   rotary: RotaryEmbedding) -> nn.Module:
        if cfg.is_sparse_layer(layer):
            mlp: nn.Module = Qwen3MoeSparseBlock(cfg, layer, hooks)
        else:
            mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        return LlamaDecoderLayer(cfg, layer, hooks, backend, rotary, mlp=mlp)

    @classmethod
    def hook_layout(cls, cfg: MoeConfig) -> HookLayout:
        """Router logits at the sparse layers only (the dense ``mlp_only`` ones have no router)."""
        return HookLayout.build(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.router_layers,
                                cfg.num_experts, [cfg.attention_window(layer) for layer in range(cfg.num_layers)])

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
