"""Structured-output request fields as vLLM serves them: ``structured_outputs``, the legacy
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and OpenAI's
``response_format``, into one ``StructuredOutputsParams`` whose errors name the field sent."""

from __future__ import annotations

import re
from typing import Any

from steerable.errors import InvalidRequestError
from steerable.sampling_params import StructuredOutputsParams

_LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_BACKENDS = (None, "auto", "xgrammar")


def structured_from_body(extra: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint of a request's extra fields, or None; at most one source may be given."""
    backend = extra.get("guided_decoding_backend")
    if backend not in _BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend: only 'xgrammar' (or 'auto') is available, got {backend!r}")
    if extra.get("guided_whitespace_pattern") is not None:
        raise InvalidRequestError("guided_whitespace_pattern: not supported (the xgrammar backend has no whitespace "
                                  "pattern)")
    found: list[tuple[str, StructuredOutputsParams]] = []
    if extra.get("structured_outputs") is not None:
        found.append(("structured_outputs", StructuredOutputsParams.coerce(extra["structured_outputs"])))
    for name, kind in _LEGACY.items():
        if extra.get(name) is not None:
            found.append((name, _labelled(name, **{kind: extra[name]})))
    fmt = extra.get("response_format")
    if fmt is not None:
        params = _response_format(fmt)
        if params is not None:
            found.append(("response_format", params))
    if len(found) > 1:
        raise InvalidRequestError(f"{found[1][0]}: give one structured-output constraint, got "
                                  f"{', '.join(name for name, _ in found)}")
    return found[0][1] if found else None


def _response_format(fmt: Any) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _labelled("response_format", json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema: required for type 'json_schema', an object "
                                      "with 'name' and 'schema'")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format.json_schema.schema: must be a JSON schema object")
        return _labelled("response_format.json_schema.schema", json=schema)
    raise InvalidRequestError(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _labelled(field: str, **constraint: Any) -> StructuredOutputsParams:
    """Built from one field of the request, and named after it in every error about it."""
    try:
        params = StructuredOutputsParams(**constraint)
    except InvalidRequestError as err:
        raise InvalidRequestError(re.sub(r"^structured_outputs(\.\w+)?", field, str(err))) from None
    params._field = field
    return params
