"""The tool calls that a grammar forces (``tool_choice: "required"`` or a named function): the
output is JSON the tool schemas allow, read here as calls."""

from __future__ import annotations

from typing import Any

from steerable.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedText, ToolParser, call_from_json
from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON, read_json


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's schema of ``tool_choice: "required"``: a non-empty list of ``{"name", "parameters"}``,
    each one of the tools."""
    options = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                 "parameters": parameters_schema(tool)},
                "required": ["name", "parameters"]} for tool in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": options}}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class RequiredToolParser(ToolParser):
    """The JSON list of ``tool_choice: "required"``."""

    def parse(self, text: str, final: bool) -> ParsedText:
        out = ParsedText()
        try:
            node = read_json(text)
            if node is None or node.kind != "array":
                raise MalformedJSON("expected a list of calls")
            out.calls = [call_from_json(item, ("parameters",)) for _, item in node.members if item is not None]
            out.malformed = final and not (node.complete and out.calls and not text[node.end:].strip())
        except MalformedJSON:
            out.malformed = final
        return out


class NamedToolParser(ToolParser):
    """The arguments object of the function ``tool_choice`` names."""

    def __init__(self, name: str, tools: list[dict[str, Any]] | None = None):
        super().__init__(tools)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        out = ParsedText()
        try:
            node = read_json(text)
            if node is not None and node.kind != "object":
                raise MalformedJSON("expected the arguments object")
        except MalformedJSON:
            out.malformed = final
            return out
        if node is not None:
            out.calls = [ParsedCall(self.name, node.canonical(), node.complete)]
        out.malformed = final and (node is None or not node.complete or text[node.end:].strip() != "")
        return out
