"""``qwen3``: Qwen3's ``<think>`` blocks. ``chat_template_kwargs: {"enable_thinking": false}`` turns
reasoning off, as the template does."""

from __future__ import annotations

from typing import Any

from steerable.entrypoints.openai.reasoning.base import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    def thinks(self, prompt_tail: str, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False and super().thinks(
            prompt_tail, chat_template_kwargs)
