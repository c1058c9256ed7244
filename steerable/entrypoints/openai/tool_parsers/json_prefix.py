"""A JSON value read from the start of a text that may still be growing (a tool call being
generated), and its canonical text so far.

The canonical text is what ``json.dumps(value, ensure_ascii=False)`` writes for the finished value,
cut where the text read so far stops being certain: a string is written up to its last complete
character, a number or a literal only once it has ended, an object member once its key is whole.
Each reading of a longer text extends the previous one's canonical text, so a stream can send the
difference and the client's concatenation equals the non-streamed ``arguments`` string, whatever
whitespace the model wrote. (An object with a repeated key reads as ``json.loads`` keeps it only
once finished; models do not write those.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_WHITESPACE = " \t\n\r"
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"true": True, "false": False, "null": None}


class MalformedJSON(ValueError):
    """The text cannot be the start of a JSON value."""


@dataclass
class PartialValue:
    """A JSON value as far as it is read: ``complete`` once its last character was seen. An
    object keeps its members as (key, value) pairs, an incomplete key as ``pending_key`` None."""

    kind: str  # "object" | "array" | "string" | "scalar"
    complete: bool = False
    text: str = ""  # a string's characters so far; a scalar's complete token
    members: list[tuple[str | None, PartialValue | None]] = field(default_factory=list)
    end: int = 0  # index in the text just after the value (when complete)

    def value(self) -> Any:
        """The Python value (of a complete value)."""
        if self.kind == "object":
            return {key: item.value() for key, item in self.members}
        if self.kind == "array":
            return [item.value() for _, item in self.members]
        if self.kind == "string":
            return self.text
        return _LITERALS[self.text] if self.text in _LITERALS else json.loads(self.text)

    def get(self, key: str) -> PartialValue | None:
        """An object's member ``key`` as far as it is read (None: not begun)."""
        for name, item in self.members:
            if name == key:
                return item
        return None

    def canonical(self) -> str:
        """``json.dumps(value, ensure_ascii=False)`` of the value, as far as it is certain."""
        if self.complete:
            return json.dumps(self.value(), ensure_ascii=False)
        if self.kind == "string":
            return json.dumps(self.text, ensure_ascii=False)[:-1]
        if self.kind == "scalar":
            return ""
        opening, separator = ("{", ", ") if self.kind == "object" else ("[", ", ")
        parts = []
        for key, item in self.members:
            if key is None and self.kind == "object":
                break  # its key is still being written
            prefix = json.dumps(key, ensure_ascii=False) + ": " if self.kind == "object" else ""
            parts.append(prefix + ("" if item is None else item.canonical()))
        return opening + separator.join(parts)


def read_json(text: str, start: int = 0) -> PartialValue | None:
    """The JSON value beginning at ``start`` (after whitespace) of ``text``; None if only whitespace
    is there yet. Raises ``MalformedJSON`` where the text cannot continue a JSON value."""
    i = _skip(text, start)
    if i == len(text):
        return None
    return _Reader(text).value(i)


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


class _Reader:
    def __init__(self, text: str):
        self.text = text

    def value(self, i: int) -> PartialValue:
        char = self.text[i]
        if char == "{":
            return self.container(i, "object", "}")
        if char == "[":
            return self.container(i, "array", "]")
        if char == '"':
            return self.string(i)
        return self.scalar(i)

    def container(self, i: int, kind: str, closing: str) -> PartialValue:
        text = self.text
        node = PartialValue(kind)
        i = _skip(text, i + 1)
        if i < len(text) and text[i] == closing:
            node.complete, node.end = True, i + 1
            return node
        while i < len(text):
            key = None
            if kind == "object":
                if text[i] != '"':
                    raise MalformedJSON(f"expected a key at {i}")
                name = self.string(i)
                if not name.complete:
                    node.members.append((None, None))
                    return node
                i = _skip(text, name.end)
                if i == len(text):
                    node.members.append((None, None))  # the key's colon may still fail to come
                    return node
                if text[i] != ":":
                    raise MalformedJSON(f"expected ':' at {i}")
                key = name.text
                i = _skip(text, i + 1)
                if i == len(text):
                    node.members.append((key, None))
                    return node
            item = self.value(i)
            node.members.append((key, item))
            if not item.complete:
                return node
            i = _skip(text, item.end)
            if i == len(text):
                return node
            if text[i] == closing:
                node.complete, node.end = True, i + 1
                return node
            if text[i] != ",":
                raise MalformedJSON(f"expected ',' or {closing!r} at {i}")
            i = _skip(text, i + 1)
        return node

    def string(self, i: int) -> PartialValue:
        """A string from its opening quote: complete, or its characters up to the last one whose
        escape is whole (a high surrogate waits for its pair)."""
        text = self.text
        j = i + 1
        safe = j  # the raw body up to here decodes on its own
        while j < len(text):
            char = text[j]
            if char == '"':
                node = PartialValue("string", complete=True, end=j + 1)
                node.text = self._decode(text[i + 1:j])
                return node
            if char == "\\":
                if j + 1 >= len(text):
                    break
                if text[j + 1] == "u":
                    if j + 6 > len(text):
                        break
                    code = int(text[j + 2:j + 6], 16) if _is_hex(text[j + 2:j + 6]) else -1
                    if code < 0:
                        raise MalformedJSON(f"bad \\u escape at {j}")
                    if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or neither
                        if j + 12 > len(text):
                            break
                        j += 12
                    else:
                        j += 6
                else:
                    j += 2
            elif char < " ":
                raise MalformedJSON(f"control character in a string at {j}")
            else:
                j += 1
            safe = j
        node = PartialValue("string")
        node.text = self._decode(text[i + 1:safe])
        return node

    @staticmethod
    def _decode(body: str) -> str:
        try:
            return json.loads(f'"{body}"')
        except ValueError as err:
            raise MalformedJSON(str(err)) from None

    def scalar(self, i: int) -> PartialValue:
        """A number or literal: complete once a character that cannot continue it follows."""
        text = self.text
        j = i
        while j < len(text) and (text[j] in _NUMBER_CHARS or text[j].isalpha()):
            j += 1
        token = text[i:j]
        if j == len(text):  # it may go on
            if not any(lit.startswith(token) for lit in _LITERALS) and not _could_be_number(token):
                raise MalformedJSON(f"unexpected {token!r} at {i}")
            return PartialValue("scalar")
        if token in _LITERALS:
            return PartialValue("scalar", complete=True, text=token, end=j)
        try:
            json.loads(token)
        except ValueError:
            raise MalformedJSON(f"unexpected {token or text[i]!r} at {i}") from None
        return PartialValue("scalar", complete=True, text=token, end=j)


def _is_hex(digits: str) -> bool:
    return len(digits) == 4 and all(c in "0123456789abcdefABCDEF" for c in digits)


def _could_be_number(token: str) -> bool:
    return bool(token) and all(c in _NUMBER_CHARS for c in token)
