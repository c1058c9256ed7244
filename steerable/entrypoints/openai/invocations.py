"""``POST /invocations``: the SageMaker route vLLM serves, a chat completion when the body has
``messages`` and a completion otherwise (same fields, same answers, same errors)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from steerable.entrypoints.openai.auth import require_user
from steerable.entrypoints.openai.chat import Chat
from steerable.entrypoints.openai.completions import Completion
from steerable.entrypoints.openai.errors import validation_message
from steerable.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from steerable.entrypoints.openai.state import server_state
from steerable.errors import InvalidRequestError

router = APIRouter(dependencies=[Depends(require_user)])


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except ValueError as err:
        raise InvalidRequestError(f"body: malformed JSON ({err})") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("body: expected a JSON object")
    model, flow = (ChatCompletionRequest, Chat) if "messages" in body else (CompletionRequest, Completion)
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        raise InvalidRequestError(validation_message(err.errors()[0])[1]) from None
    return await flow(server_state(request), parsed, request).respond()
