"""The synthetic steps a worker runs at start-up, so that the first requests run as fast as later
ones: every Triton kernel variant a workload meets is compiled (eagerly) and the CUDA graphs of the
decode and mixed ladders (unsteered, without capture; and sharing a prefix, where the engine
looks for shared prefixes) are captured inside ``LLM(...)``, as vLLM does.

Triton compiles one variant per combination of constexprs and of integer arguments that are 1 or a
multiple of 16 (the number of sequences, the number of MoE assignments); the attention kernel's
tile follows the longest query up to a cap. So the prefill steps cover query lengths 2, 4, ..., 128
for one, three and sixteen sequences. Every sequence writes its K/V to block 0 and reads it back:
all of the KV cache is free at start-up, and a request overwrites a slot before it reads it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from steerable.step import SamplingInput, SharedPrefix, StepInput

PREFILL_QUERY_LENS = (2, 4, 8, 16, 32, 64, 128)
PREFILL_SEQS = (1, 3, 16)


def synthetic_step(num_seqs: int, query_len: int, block_size: int, top_p: float = 1.0) -> StepInput:
    """``num_seqs`` sequences of ``query_len`` new tokens at positions 0.., each sampled once
    (``top_p < 1`` takes the sampler's filtering path, outside a decode graph)."""
    positions = np.tile(np.arange(query_len, dtype=np.int64), num_seqs)
    query_start = np.arange(num_seqs + 1, dtype=np.int64) * query_len
    slots = np.arange(num_seqs, dtype=np.int64)
    sampling = SamplingInput(rows=query_start[1:] - 1, slots=slots,
                             temperature=np.full(num_seqs, 0.6, np.float32), top_p=np.full(num_seqs, top_p, np.float32),
                             top_k=np.zeros(num_seqs, np.int64), min_p=np.zeros(num_seqs, np.float32),
                             seeds=np.arange(num_seqs, dtype=np.int64), logprobs=[None] * num_seqs)
    return StepInput(step_id=-1, token_ids=np.zeros(len(positions), np.int64), positions=positions,
                     slot_mapping=positions % block_size, query_start=query_start,
                     seq_lens=np.full(num_seqs, query_len, np.int64), request_slots=slots,
                     max_query_len=query_len, sampling=sampling)


def compile_steps(max_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> Iterator[StepInput]:
    """Prefill shapes, each fitting the step buffers and the model length."""
    for query_len in PREFILL_QUERY_LENS:
        for num_seqs in PREFILL_SEQS:
            if num_seqs <= max_num_seqs and num_seqs * query_len <= max_tokens and query_len <= max_model_len:
                yield synthetic_step(num_seqs, query_len, block_size)


def graph_steps(decode_sizes: list[int], mixed_sizes: list[int], max_num_seqs: int, max_model_len: int,
                block_size: int, shared_group: int | None) -> Iterator[StepInput]:
    """A step of every mixed size (sequences of 16 to 128 tokens, where the limits allow), then decode steps of every padded
    batch size, largest first: one that samples inside the graph and one that filters (top-p)
    outside it, the two graphs a size can need. With ``shared_group``, each mixed size and each
    decode size of two rows or more again (both ways) with a (zero-length) shared prefix: the
    graphs of the shared-prefix kernels."""
    for size in mixed_sizes:
        fits = [q for q in (128, 64, 32, 16) if size % q == 0 and q <= max_model_len and size // q <= max_num_seqs]
        if fits:
            yield synthetic_step(size // fits[0], fits[0], block_size)
            if shared_group is not None:
                yield _sharing(synthetic_step(size // fits[0], fits[0], block_size), shared_group)
    for size in sorted(decode_sizes, reverse=True):
        yield synthetic_step(size, 1, block_size)
        yield synthetic_step(size, 1, block_size, top_p=0.9)
        if shared_group is not None and size >= 2:
            yield _sharing(synthetic_step(size, 1, block_size), shared_group)
            yield _sharing(synthetic_step(size, 1, block_size, top_p=0.9), shared_group)


def _sharing(step: StepInput, group: int) -> StepInput:
    step.shared_prefix = SharedPrefix(group, np.zeros(len(step.seq_lens), dtype=np.int64))
    return step
