"""Linear layers whose weights load from checkpoint tensors through per-parameter loaders.

A parameter may carry ``weight_loader(param, tensor, shard)`` and ``num_shards`` (how many
checkpoint tensors fill it): ``MergedLinear`` stacks several checkpoint projections into one
output dimension (q|k|v, gate|up) so one GEMM computes them all. Loaders are where a tensor-
parallel rank will take its slice of each checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def default_weight_loader(param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
    param.data.copy_(tensor)


class MergedLinear(nn.Linear):
    """``y = x W^T (+ b)`` where W stacks checkpoint weights of ``sizes`` rows each, in order."""

    def __init__(self, in_features: int, sizes: Sequence[int], bias: bool = False):
        super().__init__(in_features, sum(sizes), bias=bias)
        self.sizes = list(sizes)
        for param in self.parameters():
            param.weight_loader = self._load_shard
            param.num_shards = len(self.sizes)

    def _load_shard(self, param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
        if shard is None:
            default_weight_loader(param, tensor, None)
            return
        start = sum(self.sizes[:shard])
        default_weight_loader(param.data.narrow(0, start, self.sizes[shard]), tensor, None)
