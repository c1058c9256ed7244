"""Next-token logprobs over a request's own prompt (``SamplingParams.prompt_logprobs``): for each
listed row, the logprob and rank of the prompt token it predicts and the most likely tokens.

Only steps that carry ``PromptLogprobsInput`` entries reach this; rows go through the LM head in
slices so a long prefill chunk never holds a [rows, vocab] float32 block at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from steerable.step import PromptLogprobsInput

_ROWS_PER_SLICE = 512


@torch.inference_mode()
def prompt_logprobs(hidden: torch.Tensor, entries: list[PromptLogprobsInput],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor | None]) -> list[list[torch.Tensor]] | None:
    """Per entry ``[target logprobs [R], target ranks [R], top ids [R, num], top logprobs [R, num]]``
    on the device; None on a rank without logits (which still takes part in every LM-head call,
    a collective under tensor parallelism)."""
    out = []
    for entry in entries:
        parts: list[list[torch.Tensor]] = []
        for start in range(0, len(entry.rows), _ROWS_PER_SLICE):
            rows = torch.from_numpy(entry.rows[start:start + _ROWS_PER_SLICE]).to(hidden.device)
            logits = compute_logits(hidden[rows])
            if logits is None:
                continue
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.from_numpy(entry.targets[start:start + _ROWS_PER_SLICE]).to(hidden.device)
            chosen = logprobs.gather(1, targets[:, None])
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top = logprobs.topk(entry.num, dim=-1)
            parts.append([chosen[:, 0], ranks, top.indices, top.values])
        out.append([torch.cat(column) for column in zip(*parts)])
    return out if all(out) else None


def to_host(device_results: list[list[torch.Tensor]] | None) -> list[list[np.ndarray]]:
    """The results as numpy arrays (waits for the device)."""
    return [[t.cpu().numpy() for t in entry] for entry in device_results or []]
