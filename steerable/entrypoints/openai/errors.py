"""Errors in the OpenAI/vLLM shape: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status as ``code``. Bad input is a 400 whose message (and ``param``) names the field, pydantic's
validation included (never FastAPI's 422); an engine that is shut down answers 503."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from steerable.errors import EngineDeadError

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               499: "ClientClosedRequest", 500: "InternalServerError", 503: "ServiceUnavailableError"}
# A message that starts with a field path: "max_tokens must ...", "steering_vectors.post_mlp[3].vector: ..."
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]'\"-]*?)(?::| must | is | are )")


class APIError(Exception):
    """An error answer decided by the server (auth, limits, unknown names)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientDisconnected(Exception):
    """The client went away before the answer was ready; its requests were aborted."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def classify(err: BaseException) -> tuple[int, str, str | None]:
    """(status, message, param) for an exception raised while serving a request."""
    if isinstance(err, APIError):
        return err.status, err.message, err.param
    if isinstance(err, ClientDisconnected):
        return 499, "the client closed the connection", None
    if isinstance(err, EngineDeadError):
        return 503, str(err), None
    if isinstance(err, (ValueError, TypeError)):  # InvalidRequestError is a ValueError
        message = str(err)
        match = _FIELD.match(message)
        return 400, message, match.group(1) if match else None
    logger.error("internal error while serving a request", exc_info=err)
    return 500, f"internal error: {type(err).__name__}: {err}", None


def validation_message(error: dict[str, Any]) -> tuple[str, str]:
    """(field, message) of pydantic's first error: the field's path, pydantic's words and its error
    type, which clients of vLLM match on (``seed: Input should be less than or equal to ...
    [type=less_than_equal]``)."""
    field = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
    kind = f" [type={error['type']}]" if error.get("type") else ""
    return field, f"{field}: {error.get('msg', 'invalid value')}{kind}"


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises answers in the OpenAI shape."""

    async def on_validation(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return error_response(400, f"body: malformed JSON ({detail})", "body")
        content_type = request.headers.get("content-type")
        if tuple(first.get("loc", ())) == ("body",) and not _is_json(content_type):
            # FastAPI reads a body as JSON only when it says so (a browser's form post must not
            # drive the API without a CORS preflight), as vLLM's server does.
            sent = f"'Content-Type: {content_type}'" if content_type else "no Content-Type"
            return error_response(400, f"body: send it as JSON with 'Content-Type: application/json' (the "
                                       f"request has {sent}, so the body was not read as JSON)", "body")
        field, message = validation_message(first)
        return error_response(400, message, field)

    async def on_http(_: Request, err: StarletteHTTPException) -> JSONResponse:
        message = "route not found" if err.status_code == 404 else str(err.detail)
        return error_response(err.status_code, message)

    async def on_error(_: Request, err: Exception) -> JSONResponse:
        return error_response(*classify(err))

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for expected in (APIError, ClientDisconnected, EngineDeadError, ValueError, TypeError):
        app.add_exception_handler(expected, on_error)
    app.add_exception_handler(Exception, on_error)  # a bug: answered as a 500, and logged
