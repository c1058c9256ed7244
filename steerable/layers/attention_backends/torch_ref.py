"""Reference paged attention in plain PyTorch: the CPU path and the oracle for the Triton kernels.

Same contract as ``triton_paged``: K/V for every position < seq_len is in the paged cache (after
``store_kv``; a float8 cache holds value / scale, saturated); query row i of sequence b sits at
position ``seq_len - query_len + i`` and attends causally (optionally within a sliding window;
blocks wholly before the window of the first query are not read, so a sliding-window KV group may
have released them); with ``softcap`` the scaled scores are capped as ``softcap * tanh(s / softcap)``
before the mask (Gemma 2). Loops over sequences, so it syncs with the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # the largest float8 e4m3 value: a float8 cache saturates there


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: unchanged, or ``x / scale`` saturated into float8
    (NaN as 0, as the kernels store it)."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).nan_to_num(nan=0.0).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 values of cache entries (times the scale of a float8 cache)."""
    return x.float() * scale if x.dtype == torch.float8_e4m3fn else x.float()


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # caches of any strides
    k_cache[blocks, offsets] = quantize(key[valid], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(value[valid], v_scale, v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    max_query_len: int, scale: float, sliding_window: int | None = None,
                    workspace: object = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    softcap: float | None = None) -> None:
    block_size = k_cache.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start or seq_len == 0:
            continue
        first = 0
        if sliding_window is not None:
            first = max(0, seq_len - (q_end - q_start) - sliding_window + 1) // block_size * block_size
        blocks = block_table[b, first // block_size: -(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len - first]
        values = v_cache[blocks].flatten(0, 1)[:seq_len - first]
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        k_pos = torch.arange(first, seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        query = q[q_start:q_end].transpose(0, 1)
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
        values = values.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = torch.matmul(query.float(), dequantize(keys, k_scale).transpose(1, 2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        out[q_start:q_end] = torch.matmul(probs, dequantize(values, v_scale)).transpose(0, 1).to(out.dtype)
