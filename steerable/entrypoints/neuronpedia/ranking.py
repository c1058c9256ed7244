"""``/activation/all``'s ranking, from each source's sparse features: per feature its maximum over
the prompt (and the first position where it is reached) and its sum at ``sort_by_token_indexes``;
features ranked by that sum (or, without sort indexes, by the maximum), highest first, equal keys
in feature-index order and earlier sources first (the reference's stable sorts); the top
``num_results`` with their per-token values. The same numbers as the reference's dense
``[d_sae, tokens]`` pass, without ever holding one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from steerable.capture.sparse import SparseFeatures

MAX_RESULTS = 1000  # as the reference caps num_results


def rank_features(sources: Sequence[tuple[str, SparseFeatures, int]], tokens: int, sort_by: Sequence[int],
                  num_results: int, zero_first: bool) -> list[dict[str, Any]]:
    """``sources``: (name, every active feature of each prompt row, d_sae) in the request's order;
    ``zero_first``: position 0 (a BOS) counts as 0 everywhere (``ignore_bos``)."""
    num_results = min(num_results, MAX_RESULTS)
    candidates = []  # (key, source order, feature) of each source's own top num_results
    stats = []
    for order, (_, rows, d_sae) in enumerate(sources):
        position, feature, value = _entries(rows, zero_first)
        peak = torch.zeros(d_sae).scatter_reduce(0, feature, value, "amax")
        reached = torch.where(value == peak[feature], position, tokens)  # first position at the peak
        peak_at = torch.full((d_sae,), tokens).scatter_reduce(0, feature, reached, "amin")
        peak_at = torch.where(peak > 0, peak_at, 0)  # never active: the first position, as argmax says
        weight = torch.bincount(torch.tensor(list(sort_by), dtype=torch.long), minlength=tokens)[position].float() \
            if sort_by else torch.zeros_like(value)
        summed = torch.zeros(d_sae).index_add_(0, feature, value * weight)
        key = summed if sort_by else peak
        top = torch.sort(key, descending=True, stable=True).indices[:num_results]
        candidates += [(float(key[f]), order, int(f)) for f in top]
        stats.append((peak, peak_at, summed, position, feature, value))
    candidates.sort(key=lambda c: (-c[0], c[1]))  # stable: within a source, feature-index order stays
    ranked = []
    for _, order, f in candidates[:num_results]:
        peak, peak_at, summed, position, feature, value = stats[order]
        values = torch.zeros(tokens)
        hit = feature == f
        values[position[hit]] = value[hit]
        ranked.append({"source": sources[order][0], "index": f, "values": values.tolist(),
                       "sum_values": float(summed[f]), "max_value": float(peak[f]),
                       "max_value_index": int(peak_at[f])})
    return ranked


def _entries(rows: SparseFeatures, zero_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(position, feature, value) of every kept activation, position 0's dropped when it counts as 0."""
    kept = rows.indices >= 0
    if zero_first:
        kept[0] = False
    position = torch.arange(len(rows)).unsqueeze(1).expand_as(rows.indices)[kept]
    return position, rows.indices[kept].long(), rows.values[kept].float()
