"""Turn the scheduler's decisions into a plain ``StepInput``: token columns, KV slots, block-table
changes and the sampling rows. The driver owns the mapping of requests to worker slots (rows of the
worker's block table), so every rank receives the same, complete description of the step."""

from __future__ import annotations

import numpy as np

from steerable.engine.shared_prefix import SharedPrefixDetector
from steerable.request import Request, SchedulerOutput
from steerable.step import BlockTableUpdate, PenaltyInput, SamplingInput, SharedPrefix, StepInput
from steerable.worker.sampler import noise_seed


class StepBuilder:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, num_kv_groups: int = 1,
                 shared_prefix: tuple[int, SharedPrefixDetector] | None = None):
        """``shared_prefix``: (full-attention KV group, detector) to mark decode rows that share
        leading blocks in that group's table; None: never."""
        self.block_size = block_size
        self.shared_prefix = shared_prefix
        # Host mirror of the worker's tables, one per KV group.
        self.block_rows = np.zeros((num_kv_groups, max_num_seqs + 1, max_blocks_per_seq), dtype=np.int64)
        self.slots: dict[str, int] = {}  # running request id -> its row in the block table
        self.blocks_written: dict[int, int] = {}  # row -> how many of its block ids the worker has
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: its row is free (a fresh one is written on resume)."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            del self.blocks_written[slot]
            self.free_slots.append(slot)

    def build(self, step_id: int, sched: SchedulerOutput) -> StepInput:
        for request in sched.preempted:
            self.release(request.request_id)
        scheduled = sched.scheduled
        slots, update = self._slot_rows([s.request for s in scheduled])
        num_reqs = len(scheduled)
        counts = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        starts = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
        query_start = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        max_query_len = int(counts.max())
        if max_query_len == 1:
            token_req = np.arange(num_reqs, dtype=np.int64)
            positions = starts.copy()
            token_ids = np.fromiter((s.request.all_token_ids[s.request.num_computed_tokens] for s in scheduled),
                                    dtype=np.int64, count=num_reqs)
        else:
            token_req = np.repeat(np.arange(num_reqs, dtype=np.int64), counts)
            positions = np.arange(int(query_start[-1]), dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)
            token_ids = np.empty(len(positions), dtype=np.int64)
            for i, s in enumerate(scheduled):
                start = s.request.num_computed_tokens
                token_ids[query_start[i]:query_start[i + 1]] = s.request.all_token_ids[start:start + s.num_tokens]
        bs = self.block_size
        slot_mapping = self.block_rows[:, slots[token_req], positions // bs] * bs + positions % bs
        step = StepInput(step_id, token_ids, positions, slot_mapping, query_start, starts + counts, slots,
                         max_query_len, update)
        if self.shared_prefix is not None:
            step.shared_prefix = self._shared_prefix(slots, step.seq_lens, counts)
        stops = [s.request.stop_at_layer for s in scheduled]
        if None not in stops:  # no request of the step needs the layers above these, nor a token
            step.stop_at_layer = max(stops)
        sampling_rows = [i for i, s in enumerate(scheduled) if s.samples]
        if sampling_rows:
            step.sampling = self._sampling([scheduled[i].request for i in sampling_rows],
                                           query_start[1:][sampling_rows] - 1, slots[sampling_rows])
        return step

    def _shared_prefix(self, slots: np.ndarray, seq_lens: np.ndarray, counts: np.ndarray) -> SharedPrefix | None:
        """The shared group among the step's rows of one query token (decode rows; in a mixed step
        the prefill chunks read their prefix in the unified kernel), or None."""
        group, detector = self.shared_prefix
        single = counts == 1
        if single.all():
            lengths = detector.detect(self.block_rows[group], slots, seq_lens)
            return None if lengths is None else SharedPrefix(group, lengths)
        rows = np.flatnonzero(single)
        found = detector.detect(self.block_rows[group], slots[rows], seq_lens[rows]) if len(rows) else None
        if found is None:
            return None
        lengths = np.zeros(len(slots), dtype=np.int64)
        lengths[rows] = found
        return SharedPrefix(group, lengths)

    def _slot_rows(self, requests: list[Request]) -> tuple[np.ndarray, BlockTableUpdate | None]:
        """Each request's block-table row, and the block ids the worker does not have yet."""
        rows, cols, values = [], [], []  # values: per request, [G, its new blocks]
        slots = np.empty(len(requests), dtype=np.int64)
        for i, request in enumerate(requests):
            slot = self.slots.get(request.request_id)
            if slot is None:
                slot = self.slots[request.request_id] = self.free_slots.pop()
                self.blocks_written[slot] = 0
            written = self.blocks_written[slot]
            length = len(request.block_ids[0])  # every group's list has the same logical length
            if length > written:
                # A block a windowed group does not hold is never read: any id will do there.
                new = np.maximum(np.array([blocks[written:] for blocks in request.block_ids], dtype=np.int64), 0)
                self.block_rows[:, slot, written:length] = new
                rows.extend([slot] * (length - written))
                cols.extend(range(written, length))
                values.append(new)
                self.blocks_written[slot] = length
            slots[i] = slot
        if not rows:
            return slots, None
        return slots, BlockTableUpdate(np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64),
                                       np.concatenate(values, axis=1))

    @staticmethod
    def _sampling(requests: list[Request], rows: np.ndarray, slots: np.ndarray) -> SamplingInput:
        n = len(requests)
        params = [r.params for r in requests]
        sampling = SamplingInput(
            rows=rows, slots=slots,
            temperature=np.fromiter((p.temperature for p in params), dtype=np.float32, count=n),
            top_p=np.fromiter((p.top_p for p in params), dtype=np.float32, count=n),
            top_k=np.fromiter((p.top_k for p in params), dtype=np.int64, count=n),
            min_p=np.fromiter((p.min_p for p in params), dtype=np.float32, count=n),
            seeds=np.fromiter((noise_seed(p.seed if p.seed is not None else r.sampling_seed, r.num_tokens)
                               for p, r in zip(params, requests)), dtype=np.int64, count=n),
            logprobs=[None if p.logprobs is None else (p.logprobs, list(p.logprob_token_ids or [])) for p in params])
        for i, (request, p) in enumerate(zip(requests, params)):
            if request.num_output_tokens < p.min_tokens and request.stop_token_ids:
                sampling.suppress[i] = np.array(sorted(request.stop_token_ids), dtype=np.int64)
            if p.row_bias is not None:  # logit_bias / allowed_token_ids
                bias_ids, biases, allowed = p.row_bias
                if bias_ids is not None:
                    sampling.logit_bias[i] = (bias_ids, biases)
                if allowed is not None:
                    sampling.allowed[i] = allowed
            if p.has_penalties:
                sampling.penalties.append(PenaltyInput(i, np.array(request.prompt_token_ids, dtype=np.int64),
                                                       np.array(request.output_token_ids, dtype=np.int64),
                                                       p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        return sampling
