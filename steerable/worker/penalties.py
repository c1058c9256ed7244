"""Repetition, presence and frequency penalties on the logits of the rows that sample (vLLM's
semantics, which for the repetition penalty are HF's ``RepetitionPenaltyLogitsProcessor``):

- repetition ``r``: every token seen in the prompt or the output so far has its logit divided by
  ``r`` when positive and multiplied by ``r`` when negative;
- frequency ``f`` and presence ``p`` (OpenAI): ``logit -= f * count + p * (count > 0)``, counting
  output tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]],
                    repetition: Sequence[float], frequency: Sequence[float], presence: Sequence[float]) -> None:
    """Penalise ``logits`` [S, V] (float32) in place, row i with the i-th entry of each argument."""
    vocab = logits.shape[-1]
    device = logits.device
    for i, (prompt, output) in enumerate(zip(prompt_ids, output_ids)):
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.int64, device=device), minlength=vocab)
        row = logits[i]
        if repetition[i] != 1.0:
            seen = counts > 0
            seen[torch.tensor(list(prompt), dtype=torch.int64, device=device)] = True
            penalised = torch.where(row > 0, row / repetition[i], row * repetition[i])
            row.copy_(torch.where(seen, penalised, row))
        if frequency[i] or presence[i]:
            row -= frequency[i] * counts + presence[i] * (counts > 0)
