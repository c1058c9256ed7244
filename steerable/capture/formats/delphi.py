"""delphi's latent cache (EleutherAI's auto-interpretability pipeline, ``eai-delphi``): what
``delphi.latents.LatentDataset(DIR, ...)`` loads, so delphi explains and scores steerable's
captures without running its own caching step.

Layout, as delphi's ``LatentCache.save_splits`` / ``save_config`` write it:

- ``DIR/<hookpoint>/<start>_<end>.safetensors`` for each latent range ``[start, end]`` (``end``
  inclusive; ``torch.linspace(0, d_sae, n_splits + 1)`` boundaries), each holding ``locations``
  ``[n, 3]`` = (window, position, latent - start), uint16 where the latents of the range and the
  windows fit in 16 bits, else uint32; ``activations`` float16 ``[n]``; ``tokens`` int64
  ``[windows, N]`` (every window, in every file);
- entries ordered by window, position, then latent (``torch.nonzero``'s order), one wherever
  ``|activation| > 1e-5`` (delphi's threshold);
- ``DIR/<hookpoint>/config.json``: delphi's ``CacheConfig`` fields and ``model_name``. delphi
  takes every entry of ``DIR`` for a hookpoint, so nothing else is written beside them.

The capture itself runs as a sparse corpus capture (steerable's resumable shards of the top-k
``indices``/``values`` per row) in ``DIR/<hookpoint>/.steerable``; ``finish_cache`` turns those
shards into the split files, one latent range at a time (memory: one range's entries; the shards
are read once per range), and writes ``config.json`` last (until then delphi refuses the
directory); the run then removes its shards.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load, save

from steerable.capture.output_dir import OutputDir

logger = logging.getLogger(__name__)

THRESHOLD = 1e-5  # delphi keeps latents with |activation| > 1e-5
RUN_DIR = ".steerable"  # the capture's own shards and index, inside the hookpoint directory
DEFAULT_SPLITS = 5  # delphi's CacheConfig.n_splits


def split_ranges(d_sae: int, n_splits: int) -> list[tuple[int, int]]:
    """delphi's latent ranges ``(start, end)``, ``end`` inclusive."""
    bounds = torch.linspace(0, d_sae, steps=n_splits + 1).long().tolist()
    return list(zip(bounds[:-1], [b - 1 for b in bounds[1:]]))


def shard_entries(tensors: dict[str, np.ndarray], lo: int = 0, hi: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(locations ``int64 [n, 3]``: window, position, latent) and float32 activations of a sparse
    shard's active slots whose latent lies in ``[lo, hi]``, in window, position, latent order."""
    indices, values = tensors["indices"], tensors["values"]
    keep = (np.abs(values) > THRESHOLD) & (indices >= lo)
    if hi is not None:
        keep &= indices <= hi
    row, slot = np.nonzero(keep)
    latent = indices[row, slot].astype(np.int64)
    order = np.lexsort((latent, row))
    row, slot, latent = row[order], slot[order], latent[order]
    locations = np.stack([tensors["example"][row], tensors["position"][row], latent], axis=1)
    return locations, values[row, slot]


def finish_cache(run: OutputDir, target: OutputDir, shards: list[dict[str, Any]], d_sae: int, n_splits: int,
                 config: dict[str, Any], top_k: int, sae_k: int | None) -> list[str]:
    """Write the split files and ``config.json`` under ``target`` from the run's ``shards`` (index
    entries, in corpus order); returns the split file names."""
    def shard_tensors():
        for entry in shards:
            yield load(run.read_bytes(entry["file"]))

    token_parts, saturated = [], 0
    for tensors in shard_tensors():
        token_parts.append(tensors["token_id"])
        saturated += int((np.abs(tensors["values"][:, -1]) > THRESHOLD).sum())
    tokens = np.concatenate(token_parts).reshape(-1, int(config["cache_ctx_len"]))
    if saturated and (sae_k is None or sae_k > top_k):
        logger.warning("delphi cache: %d token(s) had all top_k=%d slots active; latents beyond them were not "
                       "captured (raise --top-k to keep every active latent)", saturated, top_k)
    names = []
    for start, end in split_ranges(d_sae, n_splits):
        parts = [shard_entries(tensors, start, end) for tensors in shard_tensors()]
        locations = np.concatenate([p[0] for p in parts])
        activations = np.concatenate([p[1] for p in parts]).astype(np.float16)
        locations[:, 2] -= start
        small = not len(locations) or int(locations.max()) < 2**16  # delphi's rule (positions included)
        name = f"{start}_{end}.safetensors"
        target.write_bytes(name, save({"locations": locations.astype(np.uint16 if small else np.uint32),
                                       "activations": activations, "tokens": tokens.astype(np.int64)}))
        names.append(name)
    target.write_json("config.json", config, indent=4)
    return names


def cache_config(model: str, context_size: int, windows: int, n_splits: int, batch_size: int, source: str,
                 column: str) -> dict[str, Any]:
    """delphi's ``CacheConfig.to_dict()`` plus ``model_name`` (what its loader reads: the tokenizer
    comes from ``model_name`` when none is passed)."""
    return {"dataset_repo": source, "dataset_split": "", "dataset_name": "", "dataset_column": column,
            "batch_size": batch_size, "cache_ctx_len": context_size, "n_tokens": windows * context_size,
            "n_splits": n_splits, "model_name": model}
