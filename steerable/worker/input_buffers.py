"""Persistent device tensors for a step's inputs (CUDA graphs read them at fixed addresses), with
pinned host staging: each step's columns go up in a few non-blocking copies."""

from __future__ import annotations

import numpy as np
import torch

from steerable.step import BlockTableUpdate


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, num_kv_groups: int = 1,
                 steps_in_flight: int = 1):
        """``steps_in_flight``: how many earlier steps may still be queued on the device when a
        step is prepared: one in the engine's loop; P - 1 on a rank of a P-stage pipeline, which
        gets step N + P once step N has finished everywhere but may still be running N + 1..."""
        self.device = device
        self.max_seqs = max_seqs
        pin = device.type == "cuda"
        groups = num_kv_groups
        self.steer_row = 2 + groups
        # Rows: ids, positions, the KV slot in each KV group, steering rows.
        self.tokens = torch.zeros(3 + groups, max_tokens, dtype=torch.int64, device=device)
        self.seqs = torch.zeros(2, max_seqs + 1, dtype=torch.int32, device=device)  # query_start, seq_lens
        # Sets of host staging used in turn: a step fills a set whose last copies (steps_in_flight
        # steps ago at least) have left it, so nothing queued behind a step in flight is overwritten.
        sets = steps_in_flight + 1
        self._tokens_host = [torch.zeros(3 + groups, max_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(sets)]
        self._seqs_host = [torch.zeros(2, max_seqs + 1, dtype=torch.int32, pin_memory=pin) for _ in range(sets)]
        self._slot_index_host = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(sets)]
        self.parity = 0
        # Each running request owns a row of block ids per KV group (the last row stays zero for
        # padding); the step's block tables are gathered from them on the device.
        self.request_blocks = torch.zeros(groups, max_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(groups, max_seqs, max_blocks, dtype=torch.int32, device=device)
        self.slot_index = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        # The token each request slot sampled last: the next step's input where the host has a placeholder.
        self.last_sampled = torch.zeros(max_seqs + 1, dtype=torch.int64, device=device)

    def begin_step(self) -> None:
        self.parity = (self.parity + 1) % len(self._tokens_host)

    def write_blocks(self, update: BlockTableUpdate) -> None:
        index = torch.from_numpy(np.stack([update.rows, update.cols])).to(self.device, non_blocking=True)
        values = torch.from_numpy(update.values.astype(np.int32)).to(self.device, non_blocking=True)
        self.request_blocks[:, index[0], index[1]] = values

    def write_tokens(self, token_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, padded: int,
                     pending: np.ndarray, owners: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and KV slots ([G, padded]), padded to ``padded`` rows (padding writes
        no KV). Rows ``pending`` take the token their owner slot sampled last step, straight from
        the device."""
        n = len(token_ids)
        steer = self.steer_row
        host_tensor = self._tokens_host[self.parity]
        host = host_tensor.numpy()
        host[0, :n] = token_ids
        host[0, pending] = 0
        host[1, :n] = positions
        host[2:steer, :n] = slot_mapping
        host[:2, n:padded] = 0
        host[2:steer, n:padded] = -1
        self.tokens[:steer, :padded].copy_(host_tensor[:steer, :padded], non_blocking=True)
        if len(pending):
            rows = torch.from_numpy(pending).to(self.device, non_blocking=True)
            slots = torch.from_numpy(owners).to(self.device, non_blocking=True)
            self.tokens[0].index_copy_(0, rows, self.last_sampled.index_select(0, slots))
        return self.tokens[0, :padded], self.tokens[1, :padded], self.tokens[2:steer, :padded]

    def write_sequences(self, query_start: np.ndarray, seq_lens: np.ndarray, request_slots: np.ndarray,
                        padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query starts, sequence lengths and the block tables ([G, B, max_blocks]); when a decode
        step is padded, each padding row is a sequence of length 0 reading the all-zero block row."""
        num_seqs = len(seq_lens)
        num_tokens = int(query_start[-1])
        pad_seqs = padded if padded != num_tokens else num_seqs
        seq_tensor = self._seqs_host[self.parity]
        seq_host = seq_tensor.numpy()
        seq_host[0, :num_seqs + 1] = query_start
        seq_host[0, num_seqs + 1:pad_seqs + 1] = np.arange(num_tokens + 1, padded + 1)
        seq_host[1, :num_seqs] = seq_lens
        seq_host[1, num_seqs:pad_seqs] = 0
        self.seqs[:, :pad_seqs + 1].copy_(seq_tensor[:, :pad_seqs + 1], non_blocking=True)
        slot_tensor = self._slot_index_host[self.parity]
        slot_host = slot_tensor.numpy()
        slot_host[:num_seqs] = request_slots
        slot_host[num_seqs:pad_seqs] = self.max_seqs  # the all-zero padding row
        self.slot_index[:pad_seqs].copy_(slot_tensor[:pad_seqs], non_blocking=True)
        for group, blocks in enumerate(self.request_blocks):
            torch.index_select(blocks, 0, self.slot_index[:pad_seqs], out=self.block_table[group, :pad_seqs])
        return self.seqs[0, :pad_seqs + 1], self.seqs[1, :pad_seqs], self.block_table[:, :pad_seqs]

    def write_steering(self, index: np.ndarray, padded: int) -> torch.Tensor:
        """Each token's steering row (0 for padding)."""
        n = len(index)
        host_tensor = self._tokens_host[self.parity]
        host = host_tensor.numpy()
        steer = self.steer_row
        host[steer, :n] = index
        host[steer, n:padded] = 0
        self.tokens[steer, :padded].copy_(host_tensor[steer, :padded], non_blocking=True)
        return self.tokens[steer, :padded]
