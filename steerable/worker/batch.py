"""The tensors of one forward step, built from the scheduler's decisions.

``token_req[t]`` says which scheduled request row t belongs to and ``positions[t]`` its absolute
position: together they are what steering and capture need to act per request under continuous
batching. Planes attach their own per-step views (``steering``, ``capture``) before the forward.
All device tensors are views of the runner's persistent buffers, so a CUDA graph captured on one
step replays on the next with new contents at the same addresses.
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
    seq_lens: torch.Tensor  # int32 [B]: context + new tokens (0 for padding sequences)
    block_table: torch.Tensor  # int32 [B, max_blocks]
    max_query_len: int
    workspace: Any = None


@dataclass
class HostColumns:
    """Per-row and per-request columns of a step, built on the host in one pass."""

    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    token_req: np.ndarray  # int64 [T]
    slots: np.ndarray  # int64 [B]: each request's block-table row in the runner
    slot_mapping: np.ndarray  # int64 [T]
    query_start: np.ndarray  # int64 [B + 1]
    seq_lens: np.ndarray  # int64 [B]
    sample_rows: np.ndarray  # int64 [S]
    max_query_len: int


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # int64 [T_padded]
    positions: torch.Tensor  # int64 [T_padded]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # int64 [S]: rows whose logits are sampled
    scheduled: list[ScheduledRequest]
    num_tokens: int  # real rows; rows beyond are padding for a CUDA graph
    host: HostColumns = field(repr=False, default=None)
    steering: Any = None
    capture: Any = None
    graphed: bool = False  # replayed from a CUDA graph

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def host_positions(self) -> np.ndarray:
        return self.host.positions

    @property
    def host_token_ids(self) -> np.ndarray:
        return self.host.token_ids

    @property
    def host_query_start(self) -> np.ndarray:
        return self.host.query_start

    @property
    def is_decode_only(self) -> bool:
        return self.attn.max_query_len == 1


def build_host_columns(scheduled: list[ScheduledRequest], slots: np.ndarray, block_rows: np.ndarray,
                       block_size: int) -> HostColumns:
    """``slots[i]`` is request i's row in ``block_rows`` (its block ids), for the slot mapping."""
    num_reqs = len(scheduled)
    counts = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])
    max_query_len = int(counts.max())
    if max_query_len == 1:
        token_req = np.arange(num_reqs, dtype=np.int64)
        positions = starts.copy()
        token_ids = np.fromiter((s.request.all_token_ids[s.request.num_computed_tokens] for s in scheduled),
                                dtype=np.int64, count=num_reqs)
    else:
        token_req = np.repeat(np.arange(num_reqs, dtype=np.int64), counts)
        positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
        token_ids = np.empty(total, dtype=np.int64)
        for i, s in enumerate(scheduled):
            start = s.request.num_computed_tokens
            token_ids[query_start[i]:query_start[i + 1]] = s.request.all_token_ids[start:start + s.num_tokens]
    slot_mapping = block_rows[slots[token_req], positions // block_size] * block_size + positions % block_size
    sample_rows = query_start[1:][np.fromiter((s.samples for s in scheduled), dtype=bool, count=num_reqs)] - 1
    return HostColumns(token_ids, positions, token_req, slots, slot_mapping, query_start, starts + counts, sample_rows,
                       max_query_len)
