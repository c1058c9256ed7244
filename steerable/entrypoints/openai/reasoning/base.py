"""Reasoning split off a choice's text: what a model writes between ``<think>`` and ``</think>``
becomes ``reasoning_content``, the rest ``content`` (vLLM's ``--reasoning-parser``).

The opening tag is optional (templates that think by default put it in the prompt); text up to
the closing tag is reasoning, so a choice cut short while thinking has reasoning and no content.
A prompt that already ends its thinking (``</think>`` as its last words: the empty block Qwen3's
template writes for ``enable_thinking: false``) makes every word content. While streaming, the
split only grows: the start of a tag is held back until it is known not to be one."""

from __future__ import annotations

from typing import Any

from steerable.entrypoints.openai.tool_parsers.base import held_back


class ThinkReasoningParser:
    start, end = "<think>", "</think>"

    def __init__(self, prompt_tail: str, chat_template_kwargs: dict[str, Any] | None = None,
                 needs_start: bool = False):
        """``prompt_tail``: the last words of the prompt as text (the template's generation prompt).
        ``needs_start``: reasoning only where the answer opens with the start tag (a grammar holds
        the answer, and thinks only where it allows the tag)."""
        self.thinking = self.thinks(prompt_tail, chat_template_kwargs or {})
        self.needs_start = needs_start

    def thinks(self, prompt_tail: str, chat_template_kwargs: dict[str, Any]) -> bool:
        """Whether the answer opens with reasoning."""
        return not prompt_tail.rstrip().endswith(self.end)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``; while streaming (not ``final``), as far as certain."""
        if not self.thinking:
            return "", text
        lead = text.lstrip()
        if lead.startswith(self.start):
            body = len(text) - len(lead) + len(self.start)
        elif not final and self.start.startswith(lead):
            return "", ""  # nothing yet, or the opening tag on its way
        elif self.needs_start:
            return "", text
        else:
            body = 0
        close = text.find(self.end, body)
        if close >= 0:
            return text[body:close], text[close + len(self.end):]
        reasoning = text[body:]
        if not final:
            reasoning = reasoning[:len(reasoning) - held_back(reasoning, (self.end,))]
        return reasoning, ""
