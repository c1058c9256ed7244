"""How one chat choice's text becomes the assistant's message: reasoning split off first
(``--reasoning-parser``), then tool calls read out of the rest (``--tool-call-parser``, or the
JSON a forced ``tool_choice`` made the model write). ``message`` builds the whole message of a
finished choice; ``AssistantStream`` sends what each new piece of a streamed choice adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from steerable.entrypoints.openai.reasoning import ThinkReasoningParser
from steerable.entrypoints.openai.tool_parsers import ParsedCall, ToolParser


@dataclass
class AssistantText:
    """The parsers of one request (either may be None)."""

    reasoning: ThinkReasoningParser | None = None
    tools: ToolParser | None = None
    include_reasoning: bool = True
    forced: bool = False  # tool_choice "required" or named: the text is the calls' JSON

    def message(self, text: str, prefix: str = "") -> tuple[dict[str, Any], bool]:
        """(the message of a finished choice's ``text``, whether it calls tools); ``prefix``: echoed
        text before the content."""
        reasoning, content = self.reasoning.split(text, final=True) if self.reasoning else (None, text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            parsed = self.tools.parse(content, final=True)
            if parsed.calls and not parsed.malformed:
                calls = [self.tool_call(call) for call in parsed.calls]
                content = "" if self.forced else parsed.content
        content = prefix + content
        if self.reasoning is not None or (calls and not self.forced):
            content = content or None  # vLLM: no content at all rather than an empty one
        reasoning = (reasoning or None) if self.include_reasoning else None
        return {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                "function_call": None, "tool_calls": calls, "reasoning_content": reasoning,
                "reasoning": reasoning}, bool(calls)

    def tool_call(self, call: ParsedCall) -> dict[str, Any]:
        return {"id": self.tools.call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def stream(self) -> AssistantStream:
        return AssistantStream(self)


@dataclass
class AssistantStream:
    """One streamed choice: ``feed`` each new piece of text, get the delta's fields. Content,
    reasoning and each call's arguments only grow, so the pieces a client concatenates equal the
    message the same text makes whole."""

    parsers: AssistantText
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0
    sent_calls: list[int] = field(default_factory=list)  # argument characters sent, per call
    called: bool = False

    def feed(self, piece: str, final: bool) -> dict[str, Any]:
        self.text += piece
        parsers = self.parsers
        reasoning, content = parsers.reasoning.split(self.text, final) if parsers.reasoning else ("", self.text)
        calls: list[ParsedCall] = []
        if parsers.tools is not None:
            parsed = parsers.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls
        delta: dict[str, Any] = {}
        if len(reasoning) > self.sent_reasoning:
            if parsers.include_reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        tool_calls = self._call_deltas(calls)
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta

    def _call_deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """A new call opens with its id, type, name and the arguments so far; later chunks carry
        the arguments' next characters. Calls open in order, each once its name is whole."""
        out = []
        for index, call in enumerate(calls):
            if call.name is None:
                break
            if index == len(self.sent_calls):
                out.append({"index": index, **self.parsers.tool_call(call)})
                self.sent_calls.append(len(call.arguments))
                self.called = True
            elif len(call.arguments) > self.sent_calls[index]:
                out.append({"index": index, "function": {"arguments": call.arguments[self.sent_calls[index]:]}})
                self.sent_calls[index] = len(call.arguments)
        return out
