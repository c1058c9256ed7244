"""Logit effects: which output tokens a feature's decoder direction promotes and suppresses.

``logits[i] = (W_dec[i] * g) @ W_U.T`` with ``W_U`` the unembedding (``lm_head.weight``, rows
``[vocab, d_model]``) and ``g`` the final norm's scale (its weight, ``1 + weight`` for Gemma's),
which is what sae-dashboard computes on a TransformerLens model whose final norm is folded into
``W_U``. Per feature: the ``n_logits`` highest and lowest entries, and a histogram of all of them
(``LOGIT_BINS`` equal bins from the lowest to the highest, as sae-dashboard draws it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from safetensors.torch import load, save

from steerable.errors import InvalidRequestError
from steerable.sae.model import SAE

LOGIT_BINS = 50
_FEATURES_AT_ONCE = 256  # bounds the [features, vocab] blocks: 156 MB of float32 logits at 151,936 tokens


@dataclass
class LogitTables:
    """``[F, n_logits]`` token ids and values, highest first (``top``) and lowest first
    (``bottom``); ``hist`` ``[F, LOGIT_BINS]`` over ``[low, high]`` per feature."""

    top_ids: torch.Tensor
    top_values: torch.Tensor
    bottom_ids: torch.Tensor
    bottom_values: torch.Tensor
    hist: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"logits.{f.name}": getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_state_dict(tensors: dict[str, torch.Tensor]) -> "LogitTables":
        return LogitTables(*(tensors[f"logits.{f.name}"] for f in fields(LogitTables)))

    def to_bytes(self) -> bytes:
        return save({k: t.contiguous() for k, t in self.state_dict().items()})

    @staticmethod
    def from_bytes(data: bytes) -> "LogitTables":
        return LogitTables.from_state_dict(load(data))


def unembedding(engine: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_U [vocab, d_model], g [d_model] float32)`` of the engine's model, on its device. Read
    from the model in this process: a tensor- or pipeline-parallel engine keeps them on other ranks."""
    model = getattr(engine.worker, "model", None)
    if model is None or getattr(model, "lm_head", None) is None or getattr(model, "norm", None) is None:
        raise InvalidRequestError("llm: feature dashboards read the unembedding from the model in this process; "
                                  "an engine with tensor_parallel_size or pipeline_parallel_size > 1 keeps it on "
                                  "other ranks")
    head, norm = model.lm_head, model.norm
    scale = norm.weight.detach().float() + (1.0 if getattr(norm, "unit_offset", False) else 0.0)
    return head.weight.detach()[:head.vocab_size], scale


def logit_tables(sae: SAE, features: torch.Tensor, W_U: torch.Tensor, scale: torch.Tensor, n_logits: int
                 ) -> LogitTables:
    """The tables of ``features`` (global indices), computed on ``W_U``'s device in float32 products."""
    device = W_U.device
    n = min(n_logits, W_U.shape[0])
    parts: list[list[torch.Tensor]] = []
    for start in range(0, len(features), _FEATURES_AT_ONCE):
        rows = sae.W_dec[features[start:start + _FEATURES_AT_ONCE]].to(device, torch.float32) * scale.to(device)
        if W_U.is_cuda and W_U.dtype != torch.float32:
            logits = torch.mm(rows.to(W_U.dtype), W_U.T, out_dtype=torch.float32)
        else:
            logits = torch.mm(rows, W_U.float().T)
        top = torch.topk(logits, n, dim=1)
        bottom = torch.topk(logits, n, dim=1, largest=False)
        low, high = logits.amin(1), logits.amax(1)
        width = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
        index = ((logits - low.unsqueeze(1)) / width.unsqueeze(1) * LOGIT_BINS).long().clamp_(0, LOGIT_BINS - 1)
        hist = torch.zeros(len(rows), LOGIT_BINS, dtype=torch.long, device=device).scatter_add_(
            1, index, index.new_ones(()).expand_as(index))
        parts.append([t.cpu() for t in (top.indices, top.values, bottom.indices, bottom.values, hist, low, high)])
    return LogitTables(*(torch.cat(column) for column in zip(*parts)))
