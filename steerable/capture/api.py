"""``steerable.capture(llm, prompts, ...)``: generate and collect labelled activations in one call."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steerable.capture.patterns import AttentionPatterns, concat_captured
from steerable.capture.serialization import CaptureMeta
from steerable.capture.sparse import SparseFeatures
from steerable.capture.session import CaptureSpec
from steerable.hook_points import HIDDEN_STATES, POST_MLP
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams


@dataclass
class CaptureResult:
    """Rows of one stream for a list of prompts, in prompt order and, within a prompt, by position.
    For ``sae_features`` the keys are SAE names and the rows ``SparseFeatures``."""

    stream: str
    outputs: list[RequestOutput]
    layouts: dict[Any, dict[str, Any]]

    @property
    def layer_ids(self) -> list[Any]:
        return sorted(self.outputs[0].captures.get(self.stream, {})) if self.outputs else []

    def sample(self, i: int) -> dict[Any, torch.Tensor | AttentionPatterns | SparseFeatures]:
        """{layer: Tensor[rows, width]} (``AttentionPatterns``; or {SAE name: SparseFeatures}) of prompt i."""
        return dict(self.outputs[i].captures.get(self.stream, {}))

    def rows(self, layer: Any) -> torch.Tensor | AttentionPatterns | SparseFeatures:
        """Every prompt's rows at ``layer`` (or of an SAE), stacked (labels in ``meta(layer)``);
        attention patterns as one ``AttentionPatterns``."""
        parts = [out.captures[self.stream][layer] for out in self.outputs]
        return concat_captured(parts)

    def meta(self, layer: Any) -> CaptureMeta:
        return CaptureMeta.concat([out.capture_meta[self.stream][layer] for out in self.outputs])

    def to_nested(self) -> list[dict[int, torch.Tensor]]:
        return [self.sample(i) for i in range(len(self.outputs))]

    def __len__(self) -> int:
        return len(self.outputs)

    def __repr__(self) -> str:
        rows = {key: sum(len(out.captures[self.stream][key]) for out in self.outputs) for key in self.layer_ids}
        return (f"CaptureResult(stream={self.stream!r}, prompts={len(self)}, layers={self.layer_ids}, rows={rows}, "
                f"layouts={self.layouts})")


def capture(llm: Any, prompts: str | Sequence[Any], layers: Sequence[int] | None = None, stream: str = HIDDEN_STATES,
            select: Any = "last_prompt", max_tokens: int = 1, dtype: str | None = None, hook: str = POST_MLP,
            use_tqdm: bool = False, saes: Sequence[str] | None = None, top_k: int = 32,
            **sampling_kwargs: Any) -> CaptureResult:
    """Generate for ``prompts`` while capturing ``stream`` at ``layers`` on the rows ``select`` picks
    (default: the last prompt token, the row whose output predicts the first generated token);
    ``stream="sae_features"`` keeps the ``top_k`` highest features of each SAE in ``saes``.

    Sampling is greedy unless ``temperature`` is passed; other ``SamplingParams`` fields pass through.
    """
    prompt_list = [prompts] if isinstance(prompts, str) else list(prompts)
    sampling_kwargs.setdefault("temperature", 0.0)
    spec = CaptureSpec(stream=stream, layers=layers, select=select, dtype=dtype, hook=hook, saes=saes, top_k=top_k)
    params = SamplingParams(max_tokens=max_tokens, capture=spec, **sampling_kwargs)
    outputs = llm.generate(prompt_list, params, use_tqdm=use_tqdm)
    layouts = llm.capture_status(stream)["layouts"]
    return CaptureResult(stream, outputs, {layer: layouts[layer] for layer in (outputs[0].captures.get(stream, {})
                                                                               if outputs else {})})


def capture_batches(llm: Any, prompts: Sequence[Any], batch_size: int = 64, consumer: Any = None,
                    **kwargs: Any) -> Iterator[CaptureResult]:
    """``capture`` over ``prompts`` in batches, yielding each batch's result so memory stays bounded
    by one batch; a consumer (e.g. ``FilesystemConsumer``) also receives every request's rows."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    prompts = list(prompts)
    if consumer is not None:
        llm.add_capture_consumer(consumer)
    try:
        for start in range(0, len(prompts), batch_size):
            yield capture(llm, prompts[start:start + batch_size], **kwargs)
    finally:
        if consumer is not None:
            llm.remove_capture_consumer(consumer)
