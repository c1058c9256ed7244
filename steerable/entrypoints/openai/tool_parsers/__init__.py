"""Tool-call parsers by ``--tool-call-parser`` name (vLLM's names), one module per format."""

from __future__ import annotations

from steerable.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedText, ToolParser
from steerable.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from steerable.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from steerable.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from steerable.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedText", "ToolParser"]
