"""The tensors of one forward step, built from the scheduler's decisions.

``token_req[t]`` says which scheduled request row t belongs to and ``positions[t]`` its absolute
position: together they are what steering and capture need to act per request under continuous
batching. Planes attach their own per-step views (``steering``, ``capture``) before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steerable.engine.scheduler import ScheduledRequest


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]; -1 marks padding rows
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: context + new tokens
    block_table: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    workspace: Any = None


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    token_req: torch.Tensor  # int64 [T]: index into ``scheduled``
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]: rows whose logits are sampled
    scheduled: list[ScheduledRequest]
    num_tokens: int
    # Host copies of the per-row columns, for planes that plan on the CPU.
    host_positions: np.ndarray = field(repr=False, default=None)
    host_token_ids: np.ndarray = field(repr=False, default=None)
    host_token_req: np.ndarray = field(repr=False, default=None)
    host_query_start: np.ndarray = field(repr=False, default=None)
    steering: Any = None
    capture: Any = None

    @property
    def is_decode_only(self) -> bool:
        return self.attn.max_query_len == 1


def build_host_columns(scheduled: list[ScheduledRequest], block_size: int) -> dict[str, np.ndarray]:
    """Per-row and per-request columns on the host, in one pass over the scheduled requests."""
    num_reqs = len(scheduled)
    counts = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])
    token_req = np.repeat(np.arange(num_reqs, dtype=np.int64), counts)
    positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
    token_ids = np.empty(total, dtype=np.int64)
    max_blocks = max(-(-(s.request.num_computed_tokens + s.num_tokens) // block_size) for s in scheduled)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, s in enumerate(scheduled):
        req = s.request
        lo, hi = query_start[i], query_start[i + 1]
        if hi - lo == 1:
            token_ids[lo] = req.all_token_ids[req.num_computed_tokens]
        else:
            token_ids[lo:hi] = req.all_token_ids[req.num_computed_tokens:req.num_computed_tokens + s.num_tokens]
        blocks = req.block_ids[:max_blocks]
        block_table[i, :len(blocks)] = blocks
    slot_mapping = block_table[token_req, positions // block_size] * block_size + positions % block_size
    sample_rows = np.fromiter((query_start[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples), dtype=np.int64)
    return {
        "token_ids": token_ids, "positions": positions, "token_req": token_req, "slot_mapping": slot_mapping,
        "query_start": query_start, "seq_lens": starts + counts, "block_table": block_table,
        "sample_rows": sample_rows, "max_query_len": int(counts.max()),
    }
