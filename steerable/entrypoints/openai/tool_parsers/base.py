"""What every tool-call parser answers: the text of one choice split into content and calls.

A parser reads the whole text each time (the text so far while streaming, ``final`` once the
choice has finished). While streaming, what it reports only grows: content is the text outside
calls minus what could still turn out to begin one (the start of a marker, trailing whitespace
that a call would swallow); a call's name appears once whole; its arguments are canonical JSON
(``json_prefix``) as far as certain. ``ToolCallStream`` turns successive readings into OpenAI's
``delta.tool_calls`` and the final reading into ``message.tool_calls``.
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from steerable.entrypoints.openai.tool_parsers.json_prefix import MalformedJSON, PartialValue, read_json


@dataclass
class ParsedCall:
    name: str | None = None  # None until the whole name is known
    arguments: str = ""  # canonical JSON text of the arguments so far
    complete: bool = False


@dataclass
class ParsedText:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    malformed: bool = False  # final reading: a call that does not parse (the text is then all content)


class ToolParser(abc.ABC):
    """One request's parser; ``tools`` are the request's tool definitions (OpenAI's form)."""

    # False where the call markers are special tokens, which the detokenizer would drop.
    skip_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = tools or []

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """``text``'s content and calls (``final``: the whole text of a finished choice)."""

    @staticmethod
    def call_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_from_json(node: PartialValue | None, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> ParsedCall:
    """A call written as ``{"name": ..., "arguments": {...}}`` (Llama writes ``parameters``)."""
    call = ParsedCall()
    if node is None:
        return call
    if node.kind != "object":
        raise MalformedJSON("a tool call is a JSON object")
    name = node.get("name")
    if name is not None and name.kind == "string" and name.complete:
        call.name = name.text
    arguments = next((node.get(key) for key in arguments_keys if node.get(key) is not None), None)
    if arguments is not None:
        call.arguments = arguments.canonical()
    call.complete = node.complete
    if node.complete and (call.name is None or arguments is None or arguments.kind != "object"):
        raise MalformedJSON("a tool call needs a string 'name' and an object of arguments")
    return call


def calls_from_json(text: str, start: int = 0) -> tuple[list[ParsedCall], int | None]:
    """One call object, or a JSON list of them, from ``start``: (calls, the index after it, or None
    while it is incomplete)."""
    node = read_json(text, start)
    if node is None:
        return [], None
    items = [item for _, item in node.members if item is not None] if node.kind == "array" else [node]
    calls = [call_from_json(item) for item in items]
    return calls, node.end if node.complete else None


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could begin one of ``markers`` (to hold back while
    streaming)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def visible_content(text: str, final: bool, markers: tuple[str, ...], after_call: bool, before_call: bool) -> str:
    """A piece of content between calls, without the whitespace next to a call. While streaming,
    the last piece (no call after it yet) holds back its trailing whitespace and anything that
    could begin a marker: a call may follow."""
    if after_call:
        text = text.lstrip()
    if before_call:
        return text.rstrip()
    if not final:
        return text[:len(text) - held_back(text, markers)].rstrip()
    return text


def parse_tagged(text: str, final: bool, tags: tuple[str, str],
                 read_block: Callable[[str, int, int], tuple[list[ParsedCall], bool]]) -> ParsedText:
    """Calls in ``start ... end`` blocks and the content around them. ``read_block(text, body, end)``
    reads the block whose body starts at ``body`` (``end``: its closing tag's index, -1 while it is
    not written): its calls so far and whether they are complete; MalformedJSON if it is no call."""
    start_tag, end_tag = tags
    out = ParsedText()
    pos, after_call = 0, False
    while True:
        start = text.find(start_tag, pos)
        piece = text[pos:] if start < 0 else text[pos:start]
        out.content += visible_content(piece, final, (start_tag,), after_call, before_call=start >= 0)
        if start < 0:
            return out
        body = start + len(start_tag)
        end = text.find(end_tag, body)
        try:
            calls, complete = read_block(text, body, end)
        except MalformedJSON:
            out.malformed = final
            return out
        out.calls.extend(calls)
        if not complete or end < 0:  # unfinished, or the closing tag is still to come (or never came)
            out.malformed = final and not complete
            return out
        pos, after_call = end + len(end_tag), True
