"""``llama3_json``: Llama 3.1-3.3's JSON calls, ``{"name": ..., "parameters": {...}}``, after an
optional ``<|python_tag|>``, several separated by ``;``. An answer that does not open with a call is
content (vLLM's parser of that name)."""

from __future__ import annotations

from steerable.entrypoints.openai.tool_parsers.base import ParsedText, ToolParser, call_from_json
from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON, read_json


class Llama3JsonToolParser(ToolParser):
    python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParsedText:
        lead = text.lstrip()
        if lead.startswith(self.python_tag):
            i = len(text) - len(lead) + len(self.python_tag)
        elif lead.startswith("{"):
            i = len(text) - len(lead)
        elif not final and self.python_tag.startswith(lead):
            return ParsedText()  # nothing but the start of what may be a call yet
        else:
            return ParsedText(content=text)
        out = ParsedText()
        try:
            while True:
                node = read_json(text, i)
                if node is None:
                    out.malformed = final and not out.calls
                    return out
                out.calls.append(call_from_json(node))
                if not node.complete:
                    out.malformed = final
                    return out
                rest = text[node.end:].lstrip()
                if not rest:
                    return out
                if not rest.startswith(";"):
                    out.malformed = final
                    return out
                i = len(text) - len(rest) + 1
        except MalformedJSON:
            out.malformed = final
            return out
