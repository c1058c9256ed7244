"""The device-side context of one forward: the attention metadata and the steering and capture
views the hook points read. The model runner builds it from a ``StepInput``; every tensor in it is
a view of a persistent buffer, so a CUDA graph captured on one step replays on the next with new
contents at the same addresses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from steerable.capture.gather import StepCapture
from steerable.steering.tables import StepSteering


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [G, T], per KV group; -1 marks padding rows
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]: context + new tokens (0 for padding sequences)
    block_table: torch.Tensor  # int32 [G, B, max_blocks], per KV group
    max_query_len: int
    workspace: Any = None  # the attention backend's scratch buffers
    # Steps whose decode rows share leading blocks of KV group ``shared_group``: each sequence's
    # shared tokens (int32 [B], 0 outside the group and for prefill chunks), and the op that reads
    # them (the backend's ``shared_prefix_attention``); None: the step shares nothing.
    prefix_lens: torch.Tensor | None = None
    shared_group: int = 0
    shared_attention: Any = None


@dataclass
class ForwardContext:
    input_ids: torch.Tensor  # int64 [T_padded]
    positions: torch.Tensor  # int64 [T_padded]
    attn: AttentionMetadata
    num_tokens: int  # real rows; rows beyond are padding for a CUDA graph
    steering: StepSteering | None = None
    capture: StepCapture | None = None
    pipeline_in: torch.Tensor | None = None  # [2, T_padded, H]: (h, delta) from the previous pipeline stage
    stop_at_layer: int | None = None  # run only the layers below it (``StepInput.stop_at_layer``)

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.attn.max_query_len == 1
