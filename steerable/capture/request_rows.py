"""What a request's own captured rows become when it finishes: the parts its destinations
collected step by step (computed rows, and rows served from the activation store) joined into one
block per destination, cut into per-layer tensors (reduced as asked) and labelled; attention
patterns cut into ragged rows."""

from __future__ import annotations

import numpy as np
import torch

from steerable.capture.activation_store import StoredRows
from steerable.capture.patterns import AttentionPatterns, assemble
from steerable.capture.planner import Destination, as_tensor
from steerable.capture.serialization import CaptureMeta
from steerable.capture.store import reduce_rows

Part = tuple["np.ndarray | StoredRows", np.ndarray, np.ndarray]  # rows [layers, n, width], positions, token ids


def parts_block(parts: list[Part]) -> np.ndarray:
    """Every layer's rows of ``parts`` (position order) in one ``[layers, rows, width]`` array:
    the part itself when there is one computed part, else one copy of each."""
    first = parts[0][0]
    if len(parts) == 1 and isinstance(first, np.ndarray):
        return first
    sample = first.sample if isinstance(first, StoredRows) else first[0]
    layers = len(first.layers) if isinstance(first, StoredRows) else first.shape[0]
    out = np.empty((layers, sum(len(p[1]) for p in parts), sample.shape[-1]), dtype=sample.dtype)
    at = 0
    for rows, positions, _ in parts:
        n = len(positions)
        if isinstance(rows, StoredRows):
            rows.copy_into(out[:, at:at + n])
        else:
            out[:, at:at + n] = rows
        at += n
    return out


def labels_of(parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
    """The positions and token ids of ``parts`` in order."""
    if not parts:
        return np.empty(0, np.int32), np.empty(0, np.int32)
    return np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def assemble_rows(request_id: str, destination: Destination, parts: list[Part], dtype: torch.dtype | None,
                  width: int, model_dtype: torch.dtype) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta]]:
    """Per layer the request's rows (views of one block), reduced as ``destination`` asks, and
    their labels (one ``CaptureMeta`` shared by the layers: the same rows at each)."""
    positions, token_ids = labels_of(parts)
    if parts:
        block = as_tensor(parts_block(parts), dtype)
    else:
        block = torch.empty(len(destination.layers), 0, width, dtype=destination.dtype or model_dtype)
    tensors, meta = {}, None
    for i, layer in enumerate(destination.layers):
        tensors[layer], kept_positions, kept_tokens = reduce_rows(block[i], positions, token_ids, destination.reduce,
                                                                  destination.budget_rows, destination.dtype)
        if meta is None:
            meta = CaptureMeta([request_id] * len(kept_positions), torch.from_numpy(kept_positions),
                               torch.from_numpy(kept_tokens))
    return tensors, {layer: meta for layer in destination.layers}


def assemble_patterns(request_id: str, destination: Destination, parts: list[Part], dtype: torch.dtype | None,
                      windows: dict[int, int | None], num_heads: int
                      ) -> tuple[dict[int, AttentionPatterns], dict[int, CaptureMeta]]:
    """A request's attention patterns per layer, cut from the padded step blocks into rows (at
    most ``budget_rows`` of them), with their labels."""
    positions, token_ids = labels_of(parts)
    keep = len(positions) if destination.budget_rows is None else min(len(positions), destination.budget_rows)
    heads = list(destination.heads) if destination.heads is not None else list(range(num_heads))
    blocks_per_layer: list[list[torch.Tensor]] = [[] for _ in destination.layers]
    left = keep
    for block, _, _ in parts:
        take = min(left, block.shape[1])
        for i in range(len(destination.layers)):
            blocks_per_layer[i].append(as_tensor(block[i, :take], dtype))
        left -= take
    meta = CaptureMeta([request_id] * keep, torch.from_numpy(positions[:keep].copy()),
                       torch.from_numpy(token_ids[:keep].copy()))
    patterns = {layer: assemble(blocks_per_layer[i], positions[:keep], windows[layer], heads)
                for i, layer in enumerate(destination.layers)}
    return patterns, {layer: meta for layer in destination.layers}
