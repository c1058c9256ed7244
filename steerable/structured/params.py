"""What a request asks its output to match (vLLM's ``StructuredOutputsParams``, same field names).

Only the description lives here, checked for shape; the grammar library compiles it when the
request is admitted (``steerable.structured.backend``), where a bad schema, regex or grammar is
refused naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field as dataclass_field, fields
from typing import Any

from steerable.errors import InvalidRequestError

# The constraint kinds: exactly one is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """``json``: a JSON schema (dict or its JSON text); ``regex``: the output fullmatches it;
    ``choice``: the output is one of these strings; ``grammar``: an EBNF (GBNF) grammar whose
    start rule is ``root``; ``json_object=True``: any JSON object. ``disable_any_whitespace``
    keeps JSON compact (no free whitespace between tokens). ``disable_additional_properties`` is
    accepted as vLLM accepts it: the grammar library's strict mode already forbids properties a
    schema does not name. ``whitespace_pattern`` and ``structural_tag`` are refused by name."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The request field the constraint came from, for error messages (a server sets it to
    # ``guided_regex``, ``response_format``, ...): travels with the params, not a constructor argument.
    _field: str = dataclass_field(default="structured_outputs", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set (``validate`` makes it exactly one)."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """What an error about the constraint names: ``structured_outputs.<kind>``, or the field it came from."""
        return f"{self._field}.{self.kind}" if self._field == "structured_outputs" else self._field

    def validate(self, field: str = "structured_outputs") -> None:
        """``ValueError`` naming ``field.<name>`` for a constraint of the wrong shape."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{field}.{name}: not supported (the xgrammar backend has no "
                                          f"{name.replace('_', ' ')})")
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(f"{field}: set exactly one of {', '.join(KINDS)}, got "
                                      f"{', '.join(set_) if set_ else 'none'}")
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as err:
                raise InvalidRequestError(f"{field}.json: not valid JSON ({err})") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(f"{field}.json: must be a JSON schema (dict or JSON text), got "
                                      f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"{field}.{name}: must be a non-empty string, got {value!r}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(f"{field}.choice: must be a non-empty list of non-empty strings, "
                                      f"got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise InvalidRequestError(f"{field}.json_object: must be a bool, got {self.json_object!r}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{field}.{name}: must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def coerce(cls, value: Any, field: str = "structured_outputs") -> StructuredOutputsParams:
        """A ``StructuredOutputsParams`` from itself or its dict form (unknown keys named)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{field}: must be a StructuredOutputsParams or a dict of its fields, got "
                                      f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"{field}: unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            return cls(**value)
        except InvalidRequestError as err:
            raise InvalidRequestError(str(err).replace("structured_outputs", field, 1)) from None

    def cache_key(self) -> tuple:
        """What the compiled grammar depends on (siblings and repeats share one compilation)."""
        spec = getattr(self, self.kind)
        if isinstance(spec, dict):
            spec = json.dumps(spec, sort_keys=True)
        elif isinstance(spec, list):
            spec = tuple(spec)
        return self.kind, spec, self.disable_any_whitespace


# vLLM's older name for the same description.
GuidedDecodingParams = StructuredOutputsParams
