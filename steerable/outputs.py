"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _short(value: Any) -> str:
    """A captured value by its shape: a tensor as ``Tensor[rows, width] dtype``, the capture types
    (``SparseFeatures``, ``AttentionPatterns``, ``CaptureMeta``) by their own short reprs."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return repr(value)


def _captures(captures: dict[str, dict[Any, Any]]) -> str:
    return "{" + ", ".join(f"{stream!r}: {{" + ", ".join(f"{key!r}: {_short(v)}" for key, v in per.items()) + "}"
                           for stream, per in captures.items()) + "}"


def _repr(obj: Any) -> str:
    """The dataclass repr, with captures by shape instead of every value."""
    parts = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        parts.append(f"{f.name}={_captures(value) if f.name in ('captures', 'capture_meta') else repr(value)}")
    return f"{type(obj).__name__}({', '.join(parts)})"


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when logprobs were asked
    # This completion's own captures once it has finished (with n > 1, RequestOutput.captures
    # holds every completion's rows together, available when the last one finishes).
    captures: dict[str, dict[int, Any]] = field(default_factory=dict)
    capture_meta: dict[str, dict[int, Any]] = field(default_factory=dict)

    __repr__ = _repr


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    captures: dict[str, dict[int, Any]] = field(default_factory=dict)
    capture_meta: dict[str, dict[int, Any]] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, Logprob entries of the token and the k most
    # likely ones at its position; None for the first token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens the prefix cache served when the request was first scheduled (vLLM's field;
    # the server's usage.prompt_tokens_details.cached_tokens). None until then.
    num_cached_tokens: int | None = None

    __repr__ = _repr
