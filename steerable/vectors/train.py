"""``train``: contrast pairs -> the engine's own capture (batched, prefix-cached) -> a ControlVector."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from steerable.capture.api import capture
from steerable.errors import InvalidRequestError
from steerable.hook_points import POST_MLP, RESIDUAL_POINTS
from steerable.vectors.control_vector import ControlVector
from steerable.vectors.extract import METHODS, direction

TOKENS = {"last": "last_prompt", "mean": "all_prompt"}


def train(llm: Any, positives: Sequence[str | list[int]], negatives: Sequence[str | list[int]],
          layers: Iterable[int] | None = None, method: str = "mean_diff", token: str = "last",
          hook: str = POST_MLP, batch_size: int = 64, normalize: bool | None = None,
          use_tqdm: bool = False) -> ControlVector:
    """A direction per layer from ``positives[i]`` vs ``negatives[i]``, read at ``hook`` on the
    last prompt token (``token="last"``) or averaged over the prompt (``"mean"``).

    Prompts go to the model as given (apply a chat template first if the behaviour lives in chat
    turns). ``layers`` defaults to 1 … L-1, the blocks a llama.cpp control vector can steer.
    ``method`` and ``normalize`` are explained in ``steerable.vectors.extract``; the result also
    records the mean residual norm per layer (over every captured row) for ``to_spec(relative=True)``.
    """
    cfg = llm.llm_engine.model_config
    layer_list = _check(cfg.num_layers, positives, negatives, layers, method, token, hook, batch_size)
    pos_rows: dict[int, list[torch.Tensor]] = {layer: [] for layer in layer_list}
    neg_rows: dict[int, list[torch.Tensor]] = {layer: [] for layer in layer_list}
    norm_sum = dict.fromkeys(layer_list, 0.0)
    norm_count = 0
    with tqdm(total=len(positives), desc="Training", unit="pair", disable=not use_tqdm) as bar:
        for start in range(0, len(positives), batch_size):
            pos, neg = positives[start:start + batch_size], negatives[start:start + batch_size]
            result = capture(llm, [*pos, *neg], layers=layer_list, select=TOKENS[token], hook=hook)
            for i in range(len(result)):
                sample = result.sample(i)
                side = pos_rows if i < len(pos) else neg_rows
                for layer in layer_list:
                    rows = sample[layer].float()
                    norm_sum[layer] += float(rows.norm(dim=1).sum())
                    side[layer].append(rows.mean(dim=0))
                norm_count += int(sample[layer_list[0]].shape[0])
            bar.update(len(pos))
    directions = {layer: torch.from_numpy(direction(method, torch.stack(pos_rows[layer]).numpy(),
                                                    torch.stack(neg_rows[layer]).numpy(), normalize))
                  for layer in layer_list}
    metadata = {"model_hint": getattr(cfg.hf_config, "model_type", None), "method": method, "layers": layer_list,
                "pairs": len(positives), "token": token, "normalize": normalize,
                "residual_norm": {layer: norm_sum[layer] / norm_count for layer in layer_list}}
    return ControlVector(directions, hook, metadata)


def _check(num_layers: int, positives: Sequence, negatives: Sequence, layers: Iterable[int] | None, method: str,
           token: str, hook: str, batch_size: int) -> list[int]:
    """Every argument checked before any work; returns the sorted layer list."""
    if isinstance(positives, str) or isinstance(negatives, str):
        raise InvalidRequestError("positives: expected lists of prompts, got a single string")
    if len(positives) != len(negatives) or not positives:
        raise InvalidRequestError(f"positives: need equally many positives and negatives (pairs), at least one; "
                                  f"got {len(positives)} and {len(negatives)}")
    if method not in METHODS:
        raise InvalidRequestError(f"method: unknown method {method!r}; expected one of {list(METHODS)}")
    if token not in TOKENS:
        raise InvalidRequestError(f"token: expected one of {list(TOKENS)}, got {token!r}")
    if hook not in RESIDUAL_POINTS:
        raise InvalidRequestError(f"hook: unknown hook {hook!r}; expected one of {list(RESIDUAL_POINTS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
    layer_list = list(range(1, num_layers) if layers is None else layers)
    bad = [layer for layer in layer_list if isinstance(layer, bool) or not isinstance(layer, (int, np.integer))
           or not 0 <= layer < num_layers]
    if bad or not layer_list:
        raise InvalidRequestError(f"layers: {bad or 'none'} not layer indices in [0, {num_layers})")
    return sorted({int(layer) for layer in layer_list})
