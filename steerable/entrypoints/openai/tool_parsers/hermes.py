"""``hermes``: calls as JSON between ``<tool_call>`` and ``</tool_call>`` (Hermes 2 Pro, Qwen2.5,
Qwen3, SmolLM3; vLLM's parser of that name). A block may hold a JSON list of calls, as SmolLM2
writes them."""

from __future__ import annotations

from steerable.entrypoints.openai.tool_parsers.base import ParsedText, ToolParser, calls_from_json, visible_content
from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON


class HermesToolParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParsedText:
        out = ParsedText()
        pos, after_call = 0, False
        while True:
            start = text.find(self.start, pos)
            piece = text[pos:] if start < 0 else text[pos:start]
            out.content += visible_content(piece, final, (self.start,), after_call, before_call=start >= 0)
            if start < 0:
                return out
            body = start + len(self.start)
            end = text.find(self.end, body)
            try:
                calls, stop = calls_from_json(text if end < 0 else text[:end], body)
            except MalformedJSON:
                out.malformed = final
                return out
            out.calls.extend(calls)
            if stop is None or (end >= 0 and text[stop:end].strip()):
                out.malformed = final  # a block whose JSON is unfinished, or followed by more than whitespace
                return out
            if end < 0:  # the closing tag is still to come (or never came)
                out.malformed = final and text[stop:].strip() != ""
                return out
            pos, after_call = end + len(self.end), True
