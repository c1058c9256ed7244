"""``hermes``: calls as JSON between ``<tool_call>`` and ``</tool_call>`` (Hermes 2 Pro, Qwen2.5,
Qwen3, SmolLM3; vLLM's parser of that name). A block may hold a JSON list of calls, as SmolLM2
writes them."""

from __future__ import annotations

from steerable.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParsedText,
    ToolParser,
    calls_from_json,
    parse_tagged,
)


class HermesToolParser(ToolParser):
    tags = ("<tool_call>", "</tool_call>")

    def parse(self, text: str, final: bool) -> ParsedText:
        return parse_tagged(text, final, self.tags, self._block)

    @staticmethod
    def _block(text: str, body: int, end: int) -> tuple[list[ParsedCall], bool]:
        """The block's JSON, complete when nothing but whitespace follows it in the block."""
        closed = end if end >= 0 else len(text)
        calls, stop = calls_from_json(text[:closed], body)
        return calls, stop is not None and not text[stop:closed].strip()
