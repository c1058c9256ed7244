"""Reasoning parsers by ``--reasoning-parser`` name (vLLM's names), one module per format:
``deepseek_r1`` is the plain ``<think>`` split of ``base``."""

from __future__ import annotations

from steerable.entrypoints.openai.reasoning.base import ThinkReasoningParser
from steerable.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
}

__all__ = ["REASONING_PARSERS", "ThinkReasoningParser"]
