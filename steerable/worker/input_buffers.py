"""Persistent device tensors for a step's inputs (CUDA graphs read them at fixed addresses), with
pinned host staging: a step's columns go up in at most three non-blocking copies, and what depends
on the device (the tokens sampled last step, each sequence's block-table rows) is gathered by
``gather`` inside the step's forward program, so a decode graph holds it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steerable.step import PLACEHOLDER, BlockTableUpdate, StepInput, to_device

# Rows of the per-token int64 block: token id (0 where pending), position, steering row, owner (the
# slot whose last sample is the input; NOT_PENDING otherwise), sampling seed, the request slot of
# each sequence (a per-sequence column: a step has no more sequences than tokens), then the KV slot
# of each token in each KV group (``steerable.kv_groups``).
IDS, POSITIONS, STEER, OWNER, SEEDS, SEQ_SLOTS, SLOTS = range(7)


@dataclass
class StepViews:
    """Device views of one step's staged inputs, padded to ``padded`` tokens / ``pad_seqs`` sequences."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor  # [G, padded]
    steer_index: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # [G, pad_seqs, max_blocks]
    seeds: torch.Tensor
    temperature: torch.Tensor
    request_slots: torch.Tensor
    prefix_lens: torch.Tensor  # int32 [pad_seqs]: shared-prefix tokens of each sequence (0: none)


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device, num_kv_groups: int = 1,
                 steps_in_flight: int = 1):
        """``steps_in_flight``: how many earlier steps may still be queued on the device when a
        step is prepared: one in the engine's loop; P - 1 on a rank of a P-stage pipeline, which
        gets step N + P once step N has finished everywhere but may still be running N + 1..."""
        self.device = device
        self.max_seqs = max_seqs
        self.not_pending = max_seqs + 1  # an entry of last_sampled that stays 0
        pin = device.type == "cuda"
        rows = SLOTS + num_kv_groups
        # A mixed step replaying a graph has max_seqs + 1 sequences: the padding one holds its padding tokens.
        max_tokens = max(max_tokens, max_seqs + 1)
        self.tokens = torch.zeros(rows, max_tokens, dtype=torch.int64, device=device)
        # query_start, seq_lens, shared-prefix lengths (steerable.step.SharedPrefix)
        self.seqs = torch.zeros(3, max_seqs + 2, dtype=torch.int32, device=device)
        self.temperature = torch.zeros(max_tokens, dtype=torch.float32, device=device)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # Sets of host staging used in turn: a step fills a set whose last copies (steps_in_flight
        # steps ago at least) have left it, so nothing queued behind a step in flight is overwritten.
        sets = steps_in_flight + 1
        self._tokens_host = [torch.zeros(rows, max_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(sets)]
        self._seqs_host = [torch.zeros(3, max_seqs + 2, dtype=torch.int32, pin_memory=pin) for _ in range(sets)]
        self._temperature_host = [torch.zeros(max_tokens, dtype=torch.float32, pin_memory=pin) for _ in range(sets)]
        self.parity = 0
        # Each running request owns a row of block ids per KV group (the last row stays zero for
        # padding); the step's block tables are gathered from them on the device.
        self.request_blocks = torch.zeros(num_kv_groups, max_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(num_kv_groups, max_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        # The token each request slot sampled last (padding sequences sample into slot max_seqs);
        # entry max_seqs + 1 is never written: the owner of every token that is not pending.
        self.last_sampled = torch.zeros(max_seqs + 2, dtype=torch.int64, device=device)

    def write_blocks(self, update: BlockTableUpdate) -> None:
        packed = to_device(np.concatenate([update.rows[None], update.cols[None], update.values]).astype(np.int64),
                           self.device)  # one copy: rows, cols, then a row of block ids per KV group
        self.request_blocks[:, packed[0], packed[1]] = packed[2:].int()

    def stage(self, step: StepInput, padded: int, pad_seqs: int | None = None, seeds: np.ndarray | None = None,
              temperature: np.ndarray | None = None) -> StepViews:
        """Copy the step's columns up, padded to ``padded`` tokens and ``pad_seqs`` sequences (a step
        replaying a graph): padding sequences read the all-zero block row, have length 0 and write
        no KV; each holds one padding token, the last one all that remain (a mixed step pads more
        tokens than sequences), so every padding row's attention output is 0. Tokens still being
        sampled (PLACEHOLDER) take their request's last sample in ``gather``. ``seeds`` and
        ``temperature`` (per token) are staged for sampling inside the forward program."""
        self.parity = (self.parity + 1) % len(self._tokens_host)
        n, num_seqs = step.num_tokens, step.num_requests
        pad_seqs = num_seqs if pad_seqs is None else pad_seqs
        if pad_seqs > self.max_seqs + 1 or (padded > n and pad_seqs == num_seqs):
            raise ValueError(f"cannot pad {num_seqs} sequences of {n} tokens to {pad_seqs} of {padded}")
        host_tensor = self._tokens_host[self.parity]
        host = host_tensor.numpy()
        pending = step.token_ids == PLACEHOLDER
        host[IDS, :n] = np.where(pending, 0, step.token_ids)
        host[POSITIONS, :n] = step.positions
        host[SLOTS:, :n] = step.slot_mapping
        host[STEER, :n] = step.steering.index if step.steering is not None else 0
        if n == num_seqs:  # one token per sequence (decode): token i belongs to sequence i
            host[OWNER, :n] = np.where(pending, step.request_slots, self.not_pending)
        else:
            host[OWNER, :n] = self.not_pending
            if pending.any():
                host[OWNER, :n][pending] = step.request_slots[step.token_request[pending]]
        host[:, n:padded] = 0
        host[SLOTS:, n:padded] = -1
        host[OWNER, n:padded] = self.not_pending
        if seeds is not None:
            host[SEEDS, :n] = seeds
        host[SEQ_SLOTS, :num_seqs] = step.request_slots
        host[SEQ_SLOTS, num_seqs:pad_seqs] = self.max_seqs  # the all-zero padding row
        width = max(padded, pad_seqs)
        self.tokens[:, :width].copy_(host_tensor[:, :width], non_blocking=True)
        seq_tensor = self._seqs_host[self.parity]
        seq_host = seq_tensor.numpy()
        seq_host[0, :num_seqs + 1] = step.query_start
        seq_host[0, num_seqs + 1:pad_seqs] = np.minimum(np.arange(n + 1, n + pad_seqs - num_seqs), padded)
        seq_host[0, pad_seqs] = padded
        seq_host[1, :num_seqs] = step.seq_lens
        seq_host[1, num_seqs:pad_seqs] = 0
        seq_host[2, :pad_seqs] = 0
        if step.shared_prefix is not None:
            seq_host[2, :num_seqs] = step.shared_prefix.lengths
        self.seqs[:, :pad_seqs + 1].copy_(seq_tensor[:, :pad_seqs + 1], non_blocking=True)
        if temperature is not None:
            temp_host = self._temperature_host[self.parity]
            temp_host.numpy()[:n] = temperature
            temp_host.numpy()[n:padded] = 0.0
            self.temperature[:padded].copy_(temp_host[:padded], non_blocking=True)
        return StepViews(self.input_ids[:padded], self.tokens[POSITIONS, :padded], self.tokens[SLOTS:, :padded],
                         self.tokens[STEER, :padded], self.seqs[0, :pad_seqs + 1], self.seqs[1, :pad_seqs],
                         self.block_table[:, :pad_seqs], self.tokens[SEEDS, :padded], self.temperature[:padded],
                         self.tokens[SEQ_SLOTS, :pad_seqs], self.seqs[2, :pad_seqs])

    def gather(self, views: StepViews) -> None:
        """On the device (inside a graph, if one runs): each token's input id (its request's last
        sample where the host had a placeholder) and each sequence's block-table row per KV group."""
        padded = views.input_ids.shape[0]
        torch.add(self.tokens[IDS, :padded], self.last_sampled.index_select(0, self.tokens[OWNER, :padded]),
                  out=views.input_ids)
        pad_seqs = views.request_slots.shape[0]
        for group, blocks in enumerate(self.request_blocks):
            torch.index_select(blocks, 0, views.request_slots, out=self.block_table[group, :pad_seqs])
