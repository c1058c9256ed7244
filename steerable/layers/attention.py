"""Paged attention layer: writes this step's K/V into the cache, then attends through a backend."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    """Stateless apart from the KV cache views the model runner binds after allocating memory."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, backend: ModuleType):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # whose block table and slots this layer's cache follows (steerable.kv_groups)

    def cache_slots(self, ctx: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache, slot_mapping): where a fused kernel may write this step's K/V itself."""
        return self.k_cache, self.v_cache, ctx.attn.slot_mapping[self.kv_group]

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, ctx: Any) -> torch.Tensor:
        """q: [T, Hq, D] (or [T, Hq*D]), k/v: [T, Hkv, D] (or flat), or None when they are already
        in the cache (see ``cache_slots``) -> [T, Hq*D]."""
        q = q.reshape(-1, self.num_heads, self.head_dim)
        meta = ctx.attn
        if k is not None:
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping[self.kv_group])
        out = torch.empty_like(q)
        self.backend.paged_attention(q, self.k_cache, self.v_cache, out, meta.query_start_loc, meta.seq_lens,
                                     meta.block_table[self.kv_group], meta.max_query_len, self.scale,
                                     self.sliding_window, meta.workspace)
        return out.view(-1, self.num_heads * self.head_dim)
