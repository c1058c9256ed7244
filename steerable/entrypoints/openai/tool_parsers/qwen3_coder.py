"""``qwen3_coder`` (and ``qwen3_xml``): Qwen3-Coder's and Qwen3.5's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

each parameter's text converted by the type the tool's JSON schema gives it (a string stays one;
integers, numbers, booleans, objects and arrays are read as JSON where they parse), as vLLM's
parser of that name does. A parameter reaches the stream once its closing tag is written."""

from __future__ import annotations

import json
import re
from typing import Any

from steerable.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedText, ToolParser, parse_tagged

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>")


class Qwen3CoderToolParser(ToolParser):
    tags = ("<tool_call>", "</tool_call>")
    function_end, parameter_end = "</function>", "</parameter>"

    def parse(self, text: str, final: bool) -> ParsedText:
        return parse_tagged(text, final, self.tags, self._block)

    def _block(self, text: str, body: int, end: int) -> tuple[list[ParsedCall], bool]:
        call, complete = self._call(text[body:end if end >= 0 else len(text)])
        return ([] if call is None else [call]), complete

    def _call(self, block: str) -> tuple[ParsedCall | None, bool]:
        """The call of one block's text (so far), and whether its function closed."""
        match = _FUNCTION.match(block)
        if match is None:
            return None, False
        name = match.group(1).strip()
        members, i = [], match.end()
        while True:
            parameter = _PARAMETER.match(block, i)
            if parameter is None:
                break
            close = block.find(self.parameter_end, parameter.end())
            if close < 0:
                break
            key = parameter.group(1).strip()
            value = self._convert(name, key, _trim(block[parameter.end():close]))
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            i = close + len(self.parameter_end)
        complete = block[i:].lstrip().startswith(self.function_end)
        return ParsedCall(name, "{" + ", ".join(members) + ("}" if complete else ""), complete), complete

    def _convert(self, function: str, key: str, value: str) -> Any:
        kind = self._schema_type(function, key)
        if value.lower() == "null" and kind != "string":
            return None
        if kind in ("integer", "number", "boolean", "object", "array"):
            try:
                parsed = json.loads(value if kind != "boolean" else value.lower())
            except ValueError:
                return value
            if kind == "integer" and isinstance(parsed, float) and parsed.is_integer():
                return int(parsed)
            return parsed
        return value

    def _schema_type(self, function: str, key: str) -> str | None:
        for tool in self.tools:
            spec = tool.get("function") or {}
            if spec.get("name") == function:
                kind = ((spec.get("parameters") or {}).get("properties") or {}).get(key, {}).get("type")
                return kind if isinstance(kind, str) else None
        return None


def _trim(value: str) -> str:
    """A parameter's text without the newline after its opening tag and before its closing one."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value
