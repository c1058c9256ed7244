"""The worker's second pass for attention patterns: for the query rows a capture selects, the
softmax over that layer's keys, read back from the paged KV cache after the layer wrote this
step's K/V, with the scores the layer's attention used (its scale, soft-cap if it has one, causal
mask and sliding window). Fused attention kernels never materialise these probabilities; this
pass costs only the selected rows (a PyTorch gather over the block table, in chunks that bound
the keys held at once), and a step without pattern rows never runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from steerable.layers.attention_backends.torch_ref import dequantize

# Keys gathered at once (rows x width x KV heads x head dim, in float32): 256 MiB.
CHUNK_ELEMENTS = 1 << 26


@dataclass
class PatternRows:
    """One group's pattern rows in a step, on the device: which step rows (query tokens), their
    sequence in the step's block table and their positions; ``width`` is the longest key range
    over the group's layers (the padded row length), a pure function of the step input, so every
    rank and stage lays out the same block."""

    rows: torch.Tensor  # int64 [n]
    seqs: torch.Tensor  # int64 [n]
    positions: torch.Tensor  # int64 [n]
    width: int

    @staticmethod
    def host_columns(rows: np.ndarray, positions: np.ndarray,
                     query_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The selected rows' sequences in the step and their positions (host side, staged with the
        step's other row indices)."""
        return np.searchsorted(query_start, rows, side="right") - 1, positions[rows]


def layer_patterns(q: torch.Tensor, attn: torch.nn.Module, block_table: torch.Tensor,
                   rows: PatternRows) -> torch.Tensor:
    """``[n, local query heads, width]`` float32 probabilities of the selected rows at ``attn``
    (a paged ``Attention``, its cache holding this step's K), zeros past each row's keys."""
    k_cache = attn.k_cache
    num_heads, num_kv, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = num_heads // num_kv
    block_size = k_cache.shape[1]
    k_scale = attn.kv_scales()[0]
    softcap = getattr(attn, "softcap", None)
    window = attn.sliding_window
    q = q.reshape(-1, num_heads, head_dim)
    n, width = rows.rows.shape[0], rows.width
    starts = torch.zeros_like(rows.positions) if window is None else (rows.positions - window + 1).clamp(min=0)
    offsets = torch.arange(width, device=q.device)
    out = torch.empty(n, num_heads, width, dtype=torch.float32, device=q.device)
    chunk = max(1, CHUNK_ELEMENTS // max(1, width * num_kv * head_dim))
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        last = rows.positions[a:b, None]
        key_pos = starts[a:b, None] + offsets
        valid = key_pos <= last
        key_pos = torch.minimum(key_pos, last)  # padding reads the row's own key; masked below
        blocks = block_table[rows.seqs[a:b, None], key_pos // block_size].long()
        keys = dequantize(k_cache[blocks, key_pos % block_size], k_scale)  # [c, width, Hkv, D]
        query = q.index_select(0, rows.rows[a:b]).float().view(b - a, num_kv, group, head_dim)
        scores = torch.einsum("chgd,cwhd->chgw", query, keys).reshape(b - a, num_heads, width) * attn.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out[a:b] = F.softmax(scores, dim=-1, dtype=torch.float32)
    return out
