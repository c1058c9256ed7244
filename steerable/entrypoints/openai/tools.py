"""A chat request's ``tools`` and ``tool_choice``, checked, and the parser that reads its calls:
``auto`` parses the model's own call syntax (the server's ``--tool-call-parser``); ``required``
and a named function hold the output to the tools' JSON schemas (structured outputs, as vLLM
does) and read that JSON; ``none`` leaves the text alone. The tools still reach the chat template
in every case."""

from __future__ import annotations

from typing import Any

from steerable.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from steerable.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    parameters_schema,
    required_schema,
)
from steerable.errors import InvalidRequestError
from steerable.sampling_params import StructuredOutputsParams

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each tool is ``{"type": "function", "function": {"name": str, "parameters": {...}?}}``."""
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f'tools[{i}]: expected {{"type": "function", "function": {{"name", '
                                      '"description", "parameters"}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}].function.name: expected a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters: expected a JSON schema object")


def tool_parser(tools: list[dict[str, Any]] | None, choice: Any, server_parser: str | None
                ) -> tuple[ToolParser | None, StructuredOutputsParams | None]:
    """(the parser of the request's calls, the constraint a forced choice puts on its output)."""
    check_tools(tools)
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's and vLLM's default
    if choice == "none":
        return None, None
    if choice == "auto":
        if server_parser is None:
            raise InvalidRequestError(f"tool_choice: {AUTO_NEEDS_FLAGS}")
        return (TOOL_PARSERS[server_parser](tools) if tools else None), None
    if not tools:
        raise InvalidRequestError(f"tool_choice: {choice!r} needs tools")
    if choice == "required":
        return RequiredToolParser(tools), _json_constraint(required_schema(tools))
    name = _named(choice)
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise InvalidRequestError(f"tool_choice.function.name: {name!r} is not one of the tools "
                                  f"{[t['function']['name'] for t in tools]}")
    return NamedToolParser(name, tools), _json_constraint(parameters_schema(tool))


def _named(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or choice.get(
            "type", "function") != "function":
        raise InvalidRequestError('tool_choice: expected "none", "auto", "required" or {"type": "function", '
                                  f'"function": {{"name": ...}}}}, got {choice!r}')
    return function["name"]


def _json_constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The schema as a constraint, without the free whitespace JSON allows (a call needs none, and a
    model unsure what comes next must not spend its tokens on spaces)."""
    try:
        params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except InvalidRequestError as err:
        raise InvalidRequestError(f"tools: a tool's parameters are not a usable JSON schema ({err})") from None
    params._field = "tool_choice"
    return params
