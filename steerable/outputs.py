"""What a finished (or streaming) request hands back to the caller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
