"""The prompt forms ``LLM.generate`` and ``AsyncLLM.generate`` accept, as vLLM names them
(``vllm.inputs``): a string, a token-id list, ``TextPrompt`` / ``TokensPrompt`` (typed dicts, so plain
dicts with the same keys work too), and the parsing that turns any of them into text or token ids
with an error naming ``prompt``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from steerable.checks import all_ints
from steerable.errors import InvalidRequestError


class TextPrompt(TypedDict):
    """A prompt as text: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
Prompt = str | Sequence[int]  # a prompt once parsed: text or token ids


def as_prompt_list(prompts: Any) -> list[Prompt]:
    """vLLM's prompt forms: a string, a token-id list, ``{"prompt": str}``, ``{"prompt_token_ids":
    [...]}``, or a list of any of them; anything else is an error naming ``prompt``."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(prompts)]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("prompt: at least one prompt is required")
        if all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in prompts):
            return [parse_prompt(prompts)]
        return [parse_prompt(p) for p in prompts]
    raise InvalidRequestError(f"prompt: expected a string, a list of token ids, a prompt dict or a list of them, "
                              f"got {type(prompts).__name__}")


def parse_prompt(prompt: Any) -> Prompt:
    """One prompt in any of vLLM's forms as text or token ids; an error naming ``prompt`` otherwise."""
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"}:
            return parse_prompt(prompt["prompt_token_ids"]) if not isinstance(prompt["prompt_token_ids"], str) else \
                _bad_prompt(prompt)
        return _bad_prompt(prompt)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
        if not all_ints(ids):
            raise InvalidRequestError("prompt: token-id prompts must be lists of integers")
        return ids
    return _bad_prompt(prompt)


def _bad_prompt(prompt: Any) -> Prompt:
    shown = sorted(prompt) if isinstance(prompt, dict) else type(prompt).__name__
    raise InvalidRequestError(f"prompt: expected a string, a list of token ids, {{'prompt': str}} or "
                              f"{{'prompt_token_ids': [int, ...]}}, got {shown}")
