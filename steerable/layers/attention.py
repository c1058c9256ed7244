"""Paged attention layer: writes this step's K/V into the cache, then attends through a backend."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

from steerable.layers import cpu_kernels, fused


def value_cache_view(flat: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int,
                     head_dim: int) -> torch.Tensor:
    """V over ``flat`` as ``[blocks, block_size, Hkv, D]``. A float8 cache on a GPU is laid out
    position-major (``[blocks, Hkv, D, block_size]`` in memory): the attention kernel then loads a
    block's positions as one vector and feeds them to the MMA without the byte-wise transpose a
    head-dim-major float8 tile needs (measured 2.06 -> 2.65 TB/s at batch 256, H200)."""
    if flat.dtype == torch.float8_e4m3fn and flat.device.type == "cuda":
        return flat.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
    return flat.view(num_blocks, block_size, num_kv_heads, head_dim)


def key_cache_view(flat: torch.Tensor, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """K over ``flat`` as ``[blocks, block_size, Hkv, D]``. Where the CPU kernels read it (float32 on
    a CPU) it is laid out position-minor (``[blocks, Hkv, D, block_size]`` in memory): the scores
    of a query over a block are then ``D`` multiply-adds of whole vectors of positions, with no sum
    across a vector per position (SmolLM2, 64 decode rows, a step's 30 layers in turn on the 2-core EPYC:
    1.8 -> 1.1 ms a layer, the kernel's time with K head-dim-minor against position-minor)."""
    if not fused.enabled(flat) and cpu_kernels.applies(flat):
        return flat.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
    return flat.view(num_blocks, block_size, num_kv_heads, head_dim)


class Attention(nn.Module):
    """Stateless apart from the KV cache views the model runner binds after allocating memory, and
    the per-tensor scales of a float8 cache (stored = value / scale; 1.0 unless a checkpoint gives
    ``k_scale``/``v_scale``). ``softcap`` (Gemma 2): scores become ``softcap * tanh(scores /
    softcap)`` before the mask and softmax, inside the backend's kernel."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None, backend: ModuleType, softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # whose block table and slots this layer's cache follows (steerable.kv_groups)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_scales(self) -> tuple[float, float]:
        """The scales the cache entries carry: a float8 cache's, else 1 (a plain cache ignores a
        checkpoint's scales)."""
        if self.k_cache is not None and self.k_cache.dtype == torch.float8_e4m3fn:
            return self.k_scale, self.v_scale
        return 1.0, 1.0

    def cache_slots(self, ctx: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
        """(k_cache, v_cache, slot_mapping, k_scale, v_scale): where and how a fused kernel may
        write this step's K/V itself."""
        return self.k_cache, self.v_cache, ctx.attn.slot_mapping[self.kv_group], *self.kv_scales()

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, ctx: Any) -> torch.Tensor:
        """q: [T, Hq, D] (or [T, Hq*D]), k/v: [T, Hkv, D] (or flat), or None when they are already
        in the cache (see ``cache_slots``) -> [T, Hq*D]."""
        q = q.reshape(-1, self.num_heads, self.head_dim)
        meta = ctx.attn
        k_scale, v_scale = self.kv_scales()
        if k is not None:
            k = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v = v.reshape(-1, self.num_kv_heads, self.head_dim)
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping[self.kv_group], k_scale, v_scale)
        out = torch.empty_like(q)
        if meta.prefix_lens is not None and self.sliding_window is None and self.kv_group == meta.shared_group:
            meta.shared_attention(q, self.k_cache, self.v_cache, out, meta.query_start_loc, meta.seq_lens,
                                  meta.block_table[self.kv_group], meta.max_query_len, meta.prefix_lens, self.scale,
                                  meta.workspace, k_scale, v_scale, self.softcap)
            return out.view(-1, self.num_heads * self.head_dim)
        self.backend.paged_attention(q, self.k_cache, self.v_cache, out, meta.query_start_loc, meta.seq_lens,
                                     meta.block_table[self.kv_group], meta.max_query_len, self.scale,
                                     self.sliding_window, meta.workspace, k_scale, v_scale, self.softcap)
        return out.view(-1, self.num_heads * self.head_dim)
