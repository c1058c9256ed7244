"""vLLM's prompt types (``vllm.inputs``): typed dicts, so plain dicts of the same keys keep working."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids: ``{"prompt_token_ids": [...]}``."""

    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
