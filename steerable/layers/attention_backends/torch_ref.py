"""Reference paged attention in plain PyTorch: the CPU path and the oracle for the Triton kernels.

Same contract as ``triton_paged``: K/V for every position < seq_len is in the paged cache (after
``store_kv``; a float8 cache holds value / scale, saturated); query row i of sequence b sits at
position ``seq_len - query_len + i`` and attends causally (optionally within a sliding window;
blocks wholly before the window of the first query are not read, so a sliding-window KV group may
have released them); with ``softcap`` the scaled scores are capped as ``softcap * tanh(s / softcap)``
before the mask (Gemma 2). Prefill rows loop over their sequences (it syncs with the device);
the decode rows of a step (one query each) attend together, as one padded batch: their K/V blocks
(whole cache blocks, not single rows) are gathered once per layer through an index built once per
step and KV group (``StepPlans``), and the query heads that share a KV head attend as that head's
rows (no copy of K/V per query head), so a CPU decode step costs a few ops per layer instead of a
few per sequence and layer. Where the CPU kernels apply (a float32 cache on a CPU,
``steerable.layers.cpu_kernels``), every query row instead attends in one kernel call that reads the
cache in place, prefill rows included (``RowPlan``); this file's ops are then the fallback and the
oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from steerable.layers import cpu_kernels

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
    if cpu_kernels.applies(key, value, k_cache, v_cache) and slot_mapping.dtype == torch.int64:
        cpu_kernels.kernels().store_kv(key, value, k_cache, v_cache, slot_mapping.contiguous())
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size  # caches of any strides
    k_cache[blocks, offsets] = quantize(key[valid], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(value[valid], v_scale, v_cache.dtype)


@dataclass
class DecodeBatch:
    """Decode rows that attend together: ``rows`` (their query rows; None: all rows of the step,
    in order), ``index`` [n, W] (cache blocks, each row's in order from the block of its first
    position; padding repeats a real block) and ``mask`` [n, 1, 1, W * block_size] (True: a
    position the row attends to)."""

    rows: torch.Tensor | None
    index: torch.Tensor
    mask: torch.Tensor


@dataclass
class DecodePlan:
    """Where a step's decode rows read their K/V (``batches``), and its sequences with more than one
    query token (``prefill``: sequence, first query row, last query row + 1)."""

    batches: list[DecodeBatch]
    prefill: list[tuple[int, int, int]]
    seq_lens: list[int]


@dataclass
class RowPlan:
    """For the CPU kernel: query row r reads the cache rows ``[first[r], length[r])`` of sequence
    ``seq[r]`` (its block-table row); int32, one entry a query row (length 0: a padding row)."""

    seq: torch.Tensor
    first: torch.Tensor
    length: torch.Tensor


def row_plan(rows: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, sliding_window: int | None) -> RowPlan:
    """Every query row's sequence and causal range (its own position and those before it, within
    the window): decode rows and prefill chunks alike."""
    starts = query_start_loc.cpu().numpy().astype(np.int64)
    lens = seq_lens.cpu().numpy().astype(np.int64)
    seq = np.repeat(np.arange(len(lens)), np.diff(starts))
    last = starts[1:][seq] - 1  # each row's sequence's last query row, at position seq_len - 1
    length = np.maximum(lens[seq] - (last - np.arange(starts[0], starts[-1])), 0)
    first = np.zeros_like(length) if sliding_window is None else np.maximum(length - sliding_window, 0)
    pad = rows - len(seq)  # rows past the last sequence's: attend to nothing
    arrays = [np.concatenate([a, np.zeros(pad, np.int64)]) for a in (seq, first, length)]
    return RowPlan(*(torch.from_numpy(a.astype(np.int32)) for a in arrays))


@dataclass
class StepPlans:
    """One step's ``DecodePlan`` (or ``RowPlan``) per (block table, window), built by the first layer that
    needs it:
    every layer of a KV group reads the same positions."""

    plans: dict[tuple[str, int, int | None], DecodePlan | RowPlan] = field(default_factory=dict)


def _split(count: np.ndarray) -> int:
    """Where to cut rows sorted by length into a short and a long batch (0: keep one): the cut
    that pads least, taken when it saves at least a tenth of the padded reads (the K/V bytes a
    decode step's attention moves; a second batch costs a few ops more)."""
    n = len(count)
    padded = np.arange(1, n) * count[:-1] + (n - np.arange(1, n)) * count[-1]
    if n < 8 or not len(padded):
        return 0
    cut = int(padded.argmin())
    return cut + 1 if padded[cut] <= 0.9 * n * count[-1] else 0


def decode_plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                sliding_window: int | None) -> DecodePlan:
    """The step's ``DecodePlan``: a decode row reads the positions of its window (all before it
    without one); rows of very different lengths go to two batches, each padded to its longest."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode, firsts, prefill = [], [], []
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start or seq_len == 0:
            continue
        if q_end - q_start > 1:
            prefill.append((b, q_start, q_end))
            continue
        decode.append(b)
        firsts.append(0 if sliding_window is None else max(0, seq_len - sliding_window))
    if not decode:
        return DecodePlan([], prefill, lens)
    seqs, first = np.asarray(decode), np.asarray(firsts)
    count = np.asarray(lens)[seqs] - first
    table = block_table.numpy() if block_table.device.type == "cpu" else block_table.cpu().numpy()
    device = query_start_loc.device
    order = np.argsort(count, kind="stable")
    cut = _split(count[order])
    groups = [order[:cut], order[cut:]] if cut else [np.arange(len(seqs))]
    every = len(decode) == len(starts) - 1 and not prefill
    batches = []
    for group in groups:
        start = first[group] // block_size  # each row's first block
        blocks = (np.asarray(lens)[seqs[group]] - 1) // block_size - start + 1
        width = int(blocks.max())
        ids = table[seqs[group, None], start[:, None] + np.minimum(np.arange(width)[None, :], blocks[:, None] - 1)]
        pos = start[:, None] * block_size + np.arange(width * block_size)[None, :]
        valid = (pos >= first[group, None]) & (pos < np.asarray(lens)[seqs[group], None])
        mask = torch.as_tensor(valid, device=device)[:, None, None, :]
        rows = None if every and len(groups) == 1 else torch.as_tensor(np.asarray(starts)[seqs[group]], device=device)
        batches.append(DecodeBatch(rows, torch.as_tensor(ids.astype(np.int64), device=device), mask))
    return DecodePlan(batches, prefill, lens)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over [..., Hq, Lq, D] queries and [..., Hkv, L, D] keys and
    values (grouped-query heads share a KV head). Without a soft-cap, PyTorch's fused CPU attention."""
    if not softcap:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = query.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32), values)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     batch: DecodeBatch, scale: float, k_scale: float, v_scale: float, softcap: float | None) -> None:
    """One batch of decode rows, attending together: K/V blocks gathered to [n, Hkv, L, D], masked
    past each row's length; the query heads of a KV head are its [group] query rows."""
    n, heads = batch.index.shape[0], k_cache.shape[2]
    # whole blocks of the engine's caches (a float8 GPU V cache is a permuted view: index_select
    # copies the blocks into the logical layout)
    flat = batch.index.view(-1)
    keys = dequantize(k_cache.index_select(0, flat), k_scale).view(n, -1, heads, k_cache.shape[3]).transpose(1, 2)
    values = dequantize(v_cache.index_select(0, flat), v_scale).view(n, -1, heads, v_cache.shape[3]).transpose(1, 2)
    query = (q if batch.rows is None else q.index_select(0, batch.rows)).float()
    query = query.view(n, heads, -1, query.shape[-1])  # [n, Hkv, group, D]: HF's repeat_interleave order
    result = _attend(query, keys, values, batch.mask, scale, softcap).reshape(n, -1, q.shape[-1]).to(out.dtype)
    if batch.rows is None:
        out.copy_(result)
    else:
        out.index_copy_(0, batch.rows, result)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                    max_query_len: int, scale: float, sliding_window: int | None = None,
                    workspace: StepPlans | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    softcap: float | None = None) -> None:
    """``workspace``: the step's ``StepPlans`` (None: the plan is built for this call alone)."""
    use_kernel = (cpu_kernels.applies(q, k_cache, v_cache, out) and block_table.dtype == torch.int32
                  and k_cache.stride(1) == 1)  # a position-minor K (``key_cache_view``)
    block_size = k_cache.shape[1]
    key = ("rows" if use_kernel else "batches", block_table.data_ptr(), sliding_window)
    plan = workspace.plans.get(key) if workspace is not None else None
    if plan is None:
        plan = (row_plan(q.shape[0], query_start_loc, seq_lens, sliding_window) if use_kernel else
                decode_plan(query_start_loc, seq_lens, block_table, block_size, sliding_window))
        if workspace is not None:
            workspace.plans[key] = plan
    if use_kernel:
        cpu_kernels.kernels().paged_attention(q, k_cache, v_cache, out, block_table, plan.seq, plan.first,
                                              plan.length, scale, softcap or 0.0)
        return
    for batch in plan.batches:
        decode_attention(q, k_cache, v_cache, out, batch, scale, k_scale, v_scale, softcap)
    for b, q_start, q_end in plan.prefill:
        seq_len = plan.seq_lens[b]
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
        # [1, H, L, D]: PyTorch's fused CPU attention takes batched 4-d inputs only
        query = q[q_start:q_end].transpose(0, 1).float()[None]
        keys = dequantize(keys, k_scale).transpose(0, 1)[None]
        values = dequantize(values, v_scale).transpose(0, 1)[None]
        out[q_start:q_end] = _attend(query, keys, values, mask, scale, softcap)[0].transpose(0, 1).to(out.dtype)
