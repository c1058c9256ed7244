"""``mistral``: calls after ``[TOOL_CALLS]``, either a JSON list of ``{"name", "arguments"}``
(Mistral 7B v0.3, Mistral tokenizers before v11) or ``name{...}`` / ``name[ARGS]{...}`` per call
(v11 and later); content is what comes before. ``[TOOL_CALLS]`` is a special token, so such
requests keep special tokens in the text. Call ids are nine letters and digits, as Mistral's
templates require (vLLM's parser of that name)."""

from __future__ import annotations

import random
import re
import string

from steerable.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ParsedText,
    ToolParser,
    calls_from_json,
    visible_content,
)
from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON, read_json

_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    skip_special_tokens = False

    @staticmethod
    def call_id() -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(self.marker)
        out = ParsedText(content=visible_content(text if start < 0 else text[:start], final, (self.marker,),
                                                 after_call=False, before_call=start >= 0))
        if start < 0:
            return out
        i = start + len(self.marker)
        try:
            if text[i:].lstrip().startswith("["):
                calls, stop = calls_from_json(text, i)
                out.calls = calls
                out.malformed = final and (stop is None or text[stop:].strip() != "")
                return out
            while i < len(text):
                i = self._named_call(text, i, out)
                if i is None:
                    break
                rest = text[i:].lstrip()
                if rest.startswith(self.marker):
                    rest = rest[len(self.marker):]
                elif rest:
                    out.malformed = final
                    break
                i = len(text) - len(rest)
        except MalformedJSON:
            out.malformed = final
        if final and (not out.calls or not out.calls[-1].complete):
            out.malformed = True
        return out

    def _named_call(self, text: str, i: int, out: ParsedText) -> int | None:
        """``name{...}`` or ``name[ARGS]{...}`` at ``i``: the index after it, None while incomplete."""
        i = len(text) - len(text[i:].lstrip())
        name = _NAME.match(text, i).group()
        j = i + len(name)
        if text.startswith(self.args_marker, j):
            j += len(self.args_marker)
        elif j == len(text) or self.args_marker.startswith(text[j:]):
            return None  # the name may go on
        node = read_json(text, j)
        if not name or (node is not None and node.kind != "object"):
            raise MalformedJSON("expected name{arguments}")
        call = ParsedCall(name=name, arguments="" if node is None else node.canonical(),
                          complete=node is not None and node.complete)
        out.calls.append(call)
        return node.end if call.complete else None
