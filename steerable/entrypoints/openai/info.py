"""Open routes (``/health``, ``/version``, ``/metrics``) and the model and tokenizer routes
(``/v1/models``, ``/tokenize``, ``/detokenize``), as vLLM serves them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

import steerable
from steerable.entrypoints.openai.auth import require_user
from steerable.entrypoints.openai.chat import apply_template
from steerable.entrypoints.openai.errors import APIError
from steerable.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from steerable.entrypoints.openai.state import server_state
from steerable.errors import EngineDeadError, InvalidRequestError

open_router = APIRouter()
router = APIRouter(dependencies=[Depends(require_user)])


@open_router.get("/health")
async def health(request: Request) -> Response:
    dead = server_state(request).llm.dead
    if dead is not None:
        raise APIError(503, str(dead))
    return Response(status_code=200)


@open_router.get("/version")
async def version() -> dict[str, str]:
    return {"version": steerable.__version__}


@open_router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    try:
        stats = await state.llm.stats()
    except EngineDeadError:
        stats = None
    return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    config = state.llm.model_config
    card = {"id": state.settings.served_model_name, "object": "model", "created": state.created,
            "owned_by": "steerable", "root": state.settings.served_model_name, "parent": None,
            "max_model_len": state.llm.max_model_len, "hidden_size": config.hidden_size,
            "num_layers": config.num_layers}
    return {"object": "list", "data": [card]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("prompt: give either prompt or messages")
    tokenizer = state.llm.tokenizer
    if body.messages is not None:
        kwargs = {**(body.chat_template_kwargs or {}), "continue_final_message": body.continue_final_message}
        if body.tools is not None:
            kwargs["tools"] = body.tools
        ids = apply_template(state, body.messages, body.add_generation_prompt, kwargs)
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids}
    out["token_strs"] = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = server_state(request)
    state.check_model(body.model)
    vocab = state.llm.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"tokens: {bad[:5]} are out of vocabulary (ids are in [0, {vocab}))")
    return {"prompt": state.llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}
