"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous block of
``ceil(vocab / ranks)`` rows (the last block padded). The embedding looks up the ids in its block,
zeroes the others and sums over the ranks; the head computes its block's logits and gathers the
full row on rank 0, the only rank that samples. With one rank both are the plain operations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steerable.distributed.groups import current_tp
from steerable.layers import gemv
from steerable.layers.linear import Weight, check_shape, default_weight_loader


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp = current_tp()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        block = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * block
        self.rows = max(0, min(block, vocab_size - self.start))  # real rows of this block
        self.weight = nn.Parameter(torch.zeros(block, hidden_size))
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, tensor: Weight, shard: int | None) -> None:
        check_shape(tensor, [self.vocab_size, self.hidden_size])
        default_weight_loader(param.data[:self.rows], tensor.narrow(0, self.start, self.rows), None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~inside.unsqueeze(-1), 0.0))


class LMHead(VocabEmbedding):
    """``logits = hidden W^T``; ``tied``: share the embedding's rows (same blocks on every rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, tied: VocabEmbedding | None = None):
        super().__init__(vocab_size, hidden_size)
        if tied is not None:
            self.weight = tied.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full logits in the model dtype on tensor-parallel rank 0; None on the other ranks."""
        logits = (gemv.cpu_linear(hidden, self.weight, None) if gemv.cpu_packed_eligible(hidden, self.weight)
                  else F.linear(hidden, self.weight))
        if self.tp.size == 1:
            return logits
        full = self.tp.gather(logits, dim=-1)
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[:, :self.vocab_size].contiguous()  # drop the padding rows of the last block

