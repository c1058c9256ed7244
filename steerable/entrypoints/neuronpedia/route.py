"""How every Neuronpedia route answers before and after its own work: the ``X-SECRET-KEY`` check
and errors in the reference server's shape, ``{"error": message}``.

The key is checked against the server's API keys (``--api-key``, ``--admin-api-key``: the keys
``Authorization: Bearer`` takes on the OpenAI side), so an open server is open here too. A body
that fails the schema is a 422 as FastAPI answers it in the reference server, with ``error``
naming the field beside FastAPI's ``detail``; bad values found later are a 400 naming the field,
an unknown model a 404, and a bug a 500 (logged), as the reference's generic handler answers."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from steerable.entrypoints.openai.auth import Keys
from steerable.entrypoints.openai.errors import classify

SECRET_HEADER = "X-SECRET-KEY"
KEY_REFUSED = "Invalid or missing X-SECRET-KEY header"


class NeuronpediaError(Exception):
    """An answer decided by a route: ``status`` and a message that starts with the field it concerns."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


def failure(err: BaseException) -> JSONResponse:
    """The answer to an exception raised while serving a Neuronpedia request."""
    if isinstance(err, NeuronpediaError):
        return error_response(err.status, err.message)
    status, message, _ = classify(err)  # bad values 400, an engine gone 503, a bug 500 (logged)
    if status == 500:
        return error_response(500, message, type=type(err).__name__)
    return error_response(status, message)


def validation_failure(err: RequestValidationError) -> JSONResponse:
    detail = jsonable_encoder(err.errors())
    first = detail[0] if detail else {}
    field = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or "body"
    return error_response(422, f"{field}: {first.get('msg', 'invalid value')}", detail=detail)


def authorized(request: Request) -> bool:
    """The secret (or a bearer token) is one of the server's keys, or the server has none."""
    keys: Keys = request.app.state.server.keys
    if not keys.user:
        return True
    secret = request.headers.get(SECRET_HEADER)
    authorization = f"Bearer {secret}" if secret else request.headers.get("authorization")
    return keys.role(authorization) is not None


class NeuronpediaRoute(APIRoute):
    """The key check comes before the body is read, as the reference's middleware does it; every
    error leaves in the reference's shape rather than the OpenAI one the rest of the app uses."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            if not authorized(request):
                return error_response(401, KEY_REFUSED)
            try:
                return await handler(request)
            except RequestValidationError as err:
                return validation_failure(err)
            except Exception as err:  # noqa: BLE001 -- every error answers in this shape, a bug as a logged 500
                return failure(err)

        return route
