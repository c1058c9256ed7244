"""Apply packed token bitmasks to logits on the worker (plain torch: no grammar library needed there).

The mask is applied to the logits after the forward, outside any CUDA graph (the logits come out
of the graph), so constrained decode steps keep replaying graphs.
"""

from __future__ import annotations

import numpy as np
import torch

from steerable.step import to_device


def apply_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Set to -inf every logit of ``rows`` whose bit in ``bitmask`` (int32 [len(rows), words]) is 0."""
    device = logits.device
    bits = to_device(bitmask, device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)  # [R, words * 32]
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = to_device(rows, device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
