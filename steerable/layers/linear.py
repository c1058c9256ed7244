"""Linear layers whose weights load from checkpoint tensors through per-parameter loaders, split
over the tensor-parallel ranks of the model being built (``distributed.groups.building``; one
rank outside it, where every layer here is a plain linear layer).

A parameter may carry ``weight_loader(param, tensor, shard)`` and ``num_shards`` (how many
checkpoint tensors fill it). Loaders narrow the checkpoint tensor to the rows or columns their
rank keeps before reading it (``models.checkpoint``):

- ``MergedLinear`` (gate|up) and ``QKVLinear`` (q|k|v) stack checkpoint projections into one
  output dimension so one GEMM computes them all. Column-parallel: a rank keeps its slice of
  *each* part, so its weight is ``[p0_r | p1_r | ...]`` and its output splits the same way. Such
  outputs are per-rank slices of several tensors: never concatenate them across ranks as one.
- ``RowLinear`` (o_proj, down_proj) splits the input features and sums the ranks' partial outputs
  with one all-reduce, so every rank holds the full (replicated) result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from steerable.distributed.groups import TPGroup, current_tp
from steerable.layers import gemv
from steerable.layers.checkpoint import CheckpointTensor, materialize

Weight = torch.Tensor | CheckpointTensor


def default_weight_loader(param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
    check_shape(tensor, param.shape)
    param.data.copy_(materialize(tensor))


def check_shape(tensor: Weight, shape: Sequence[int]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(shape)}")


def even_shard(size: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of ``size``."""
    if size % tp.size:
        raise ValueError(f"{what} ({size}) does not split evenly over {tp.size} tensor-parallel ranks")
    length = size // tp.size
    return tp.rank * length, length


def kv_head_shard(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first head, count) of the KV heads this rank keeps: an equal share, or with fewer KV heads
    than ranks one head, replicated on ``tp.size / num_kv_heads`` consecutive ranks (their query
    heads are the ones that read it)."""
    if num_kv_heads >= tp.size:
        return even_shard(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide tensor_parallel_size ({tp.size})")
    return tp.rank * num_kv_heads // tp.size, 1


class MergedLinear(nn.Linear):
    """``y = x W^T (+ b)`` where W stacks checkpoint weights of ``sizes`` rows each, in order.
    ``shards[i]``: the (start, length) rows of part i this rank keeps (default: an equal share)."""

    def __init__(self, in_features: int, sizes: Sequence[int], bias: bool = False,
                 shards: Sequence[tuple[int, int]] | None = None):
        tp = current_tp()
        self.full_sizes = list(sizes)
        self.shards = list(shards) if shards is not None else [even_shard(s, tp, "output features") for s in sizes]
        self.sizes = [length for _, length in self.shards]  # this rank's rows of each part
        super().__init__(in_features, sum(self.sizes), bias=bias)
        for param in self.parameters():
            param.weight_loader = self._load_shard
            param.num_shards = len(self.sizes)

    def _load_shard(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        """``shard``: which part the checkpoint tensor is; None: all of them, stacked."""
        parts = range(len(self.sizes)) if shard is None else [shard]
        full = [self.full_sizes[p] for p in parts]
        check_shape(tensor, [sum(full), *param.shape[1:]])
        offset = 0
        for part, size in zip(parts, full):
            start, length = self.shards[part]
            local = sum(self.sizes[:part])
            default_weight_loader(param.data.narrow(0, local, length), tensor.narrow(0, offset + start, length), None)
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemv.linear(x, self.weight, self.bias)


class QKVLinear(MergedLinear):
    """The q, k and v projections, split by heads. ``num_heads`` / ``num_kv_heads`` are this
    rank's; KV heads are replicated when there are fewer of them than ranks."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        tp = current_tp()
        q_start, q_len = even_shard(num_heads, tp, "num_attention_heads")
        kv_start, kv_len = kv_head_shard(num_kv_heads, tp)
        q = (q_start * head_dim, q_len * head_dim)
        kv = (kv_start * head_dim, kv_len * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias=bias, shards=[q, kv, kv])
        self.num_heads = q_len
        self.num_kv_heads = kv_len


class HeadInterleavedQKVLinear(QKVLinear):
    """GPT-NeoX's fused projection: the checkpoint keeps each head's q, k and v rows together
    (``[h0: q k v | h1: q k v | ...]``, multi-head attention only). A rank reads the rows of its
    own heads, one contiguous block, and regroups them into ``QKVLinear``'s ``[q | k | v]``."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, bias: bool = False):
        super().__init__(hidden_size, num_heads, num_heads, head_dim, bias=bias)
        self.head_dim = head_dim

    def _load_shard(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        if shard is not None:
            raise ValueError("a head-interleaved qkv projection loads from one fused tensor")
        check_shape(tensor, [sum(self.full_sizes), *param.shape[1:]])
        start, length = self.shards[0]  # this rank's heads, the same for q, k and v
        mine = materialize(tensor.narrow(0, 3 * start, 3 * length))
        per_head = mine.reshape(length // self.head_dim, 3, self.head_dim, *mine.shape[1:])
        param.data.copy_(per_head.transpose(0, 1).reshape(param.shape))


class RowLinear(nn.Linear):
    """``y = x W^T (+ b)`` where ``x`` holds this rank's share of the input features; the partial
    products are summed over the ranks, then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = current_tp()
        self.in_start, local = even_shard(in_features, self.tp, "input features")
        self.full_in = in_features
        super().__init__(local, out_features, bias=bias)
        self.weight.weight_loader = self._load_weight

    def _load_weight(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        check_shape(tensor, [param.shape[0], self.full_in])
        default_weight_loader(param, tensor.narrow(1, self.in_start, param.shape[1]), None)

    def forward(self, x: torch.Tensor, gated: str | None = None) -> torch.Tensor:
        """``gated`` ("silu", "gelu_tanh"): ``x`` is a gate-up projection's [gate | up] and the input
        is ``act(gate) * up``, applied inside the projection where it can be (one row)."""
        if self.tp.size == 1:
            return self._project(x, self.bias, gated)
        y = self.tp.all_reduce(self._project(x, None, gated))
        return y if self.bias is None else y + self.bias

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None, gated: str | None) -> torch.Tensor:
        if gated is None:
            return gemv.linear(x, self.weight, bias)
        return gemv.gated_linear(x, self.weight, bias, gated)
