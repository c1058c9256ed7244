"""``POST /steer/completion`` and ``/steer/completion-chat``: the STEERED and DEFAULT completions of
one prompt, from the same seed, as requests of one batch (both admitted before either is awaited;
the reference runs them one after the other). DEFAULT carries no steering at all, so it is the
unsteered request byte for byte. With ``stream`` the answer is server-sent events, each a whole
response with every type's text so far (as the reference sends them); the last one equals the
non-streamed answer."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from steerable.entrypoints.async_llm import RequestStream
from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.neuronpedia.protocol import (
    SteerCompletionChatRequest,
    SteerCompletionRequest,
    SteerRequest,
    SteerType,
)
from steerable.entrypoints.neuronpedia.requests import close, finished, submit
from steerable.entrypoints.neuronpedia.route import (
    NeuronpediaError,
    NeuronpediaRoute,
    failure,
)
from steerable.entrypoints.neuronpedia.steering import steering_spec
from steerable.entrypoints.openai.chat import apply_template
from steerable.entrypoints.openai.metrics import RequestTimer
from steerable.entrypoints.openai.serving import merge_streams
from steerable.errors import InvalidRequestError
from steerable.outputs import CompletionOutput
from steerable.sampling_params import SamplingParams
from steerable.selection import SelectSpec
from steerable.steering.spec import SteeringSpec

router = APIRouter(route_class=NeuronpediaRoute)

# (type, its completion so far or None) in the order the request gave the types -> the response body
Answer = Callable[[list[tuple[SteerType, CompletionOutput | None]]], dict[str, Any]]


@router.post("/steer/completion")
async def steer_completion(body: SteerCompletionRequest, request: Request) -> Response:
    ctx = Context(request)
    ctx.check_model(body.model)
    ids = ctx.bos_prompt(body.prompt)
    spec = await steering_spec(ctx, body)

    def answer(outputs: list[tuple[SteerType, CompletionOutput | None]]) -> dict[str, Any]:
        return {"outputs": [_output(body, kind, out, {"output": out.text if out else ""})
                            for kind, out in outputs]}

    return await run(ctx, body, ids, spec, answer, skip_special_tokens=True)


@router.post("/steer/completion-chat")
async def steer_completion_chat(body: SteerCompletionChatRequest, request: Request) -> Response:
    ctx = Context(request)
    ctx.check_model(body.model)
    if body.is_assistant_axis:
        raise NeuronpediaError(400, "is_assistant_axis: persona monitoring (the assistant axis) is not implemented "
                                    "by steerable; send false")
    messages = [{"role": m.role, "content": m.content} for m in body.prompt]
    try:
        ids = ctx.with_bos(apply_template(ctx.server, messages, add_generation_prompt=True))
    except InvalidRequestError as err:
        raise NeuronpediaError(400, "prompt" + str(err).removeprefix("messages")) from None
    ctx.check_length(ids, "prompt")
    select = None
    if not body.steer_special_tokens:  # the template's special tokens are left as they are
        special = sorted({i for i, s in zip(ids, ctx.special(ids)) if s})
        select = SelectSpec(exclude_prompt_tokens=tuple(special)) if special else None
    spec = await steering_spec(ctx, body, select)
    prompt_raw = ctx.tokenizer.decode(ids, skip_special_tokens=False)

    def answer(outputs: list[tuple[SteerType, CompletionOutput | None]]) -> dict[str, Any]:
        results = []
        for kind, out in outputs:
            content = ctx.tokenizer.decode(out.token_ids, skip_special_tokens=True) if out else ""
            results.append(_output(body, kind, out, {
                "chat_template": [*messages, {"role": "assistant", "content": content}],
                "raw": prompt_raw + (out.text if out else "")}))
        return {"outputs": results, "input": {"chat_template": messages, "raw": prompt_raw}}

    return await run(ctx, body, ids, spec, answer, skip_special_tokens=False)


def _output(body: SteerRequest, kind: SteerType, out: CompletionOutput | None, fields: dict[str, Any]
            ) -> dict[str, Any]:
    """One type's result: its fields, ``type``, and ``logprobs`` when asked for (absent otherwise)."""
    result = {"type": kind.value, **fields}
    if body.n_logprobs and out is not None and out.logprobs is not None:
        result["logprobs"] = _logprobs(out, body.n_logprobs)
    return result


def _logprobs(out: CompletionOutput, n: int) -> list[dict[str, Any]]:
    """Per generated token: its text and logprob, and the ``n`` most likely tokens, most likely first."""
    entries = []
    for token, ranked in zip(out.token_ids, out.logprobs):
        top = sorted((lp for lp in ranked.values() if lp.rank <= n), key=lambda lp: lp.rank)
        entries.append({"token": ranked[token].decoded_token or "", "logprob": _finite(ranked[token].logprob),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": _finite(lp.logprob)}
                                         for lp in top]})
    return entries


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -100.0  # JSON has no -inf; the reference's floor


def check_types(types: list[SteerType]) -> list[SteerType]:
    if len(set(types)) != len(types):
        raise NeuronpediaError(400, f"types: each type at most once, got {[t.value for t in types]}")
    if types == [SteerType.DEFAULT, SteerType.STEERED]:
        raise NeuronpediaError(400, "types: STEERED must come before DEFAULT")
    return types


async def run(ctx: Context, body: SteerRequest, ids: list[int], spec: SteeringSpec, answer: Answer,
              skip_special_tokens: bool) -> Response:
    types = check_types(body.types)
    penalty = float(body.freq_penalty)
    if not -2.0 <= penalty <= 2.0:
        raise NeuronpediaError(400, f"freq_penalty: must be in [-2, 2] (a frequency penalty on the generated "
                                    f"tokens), got {penalty}")
    if not (math.isfinite(body.seed) and -2**63 <= int(body.seed) < 2**63):
        raise NeuronpediaError(400, f"seed: must be a number that fits 64 bits, got {body.seed}")
    seed = int(body.seed)  # a fractional seed is truncated, as the reference does
    max_tokens = min(body.n_completion_tokens, ctx.llm.max_model_len - len(ids))
    params = {kind: SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature), seed=seed,
                                   frequency_penalty=penalty, logprobs=body.n_logprobs or None,
                                   skip_special_tokens=skip_special_tokens,
                                   steering_vectors=spec if kind is SteerType.STEERED else None)
              for kind in types}
    streams = await submit(ctx, [(kind.value.lower(), ids, p) for kind, p in params.items()])
    timers = [RequestTimer(ctx.server.metrics) for _ in streams]
    if body.stream:
        return StreamingResponse(_events(types, streams, timers, answer), media_type="text/event-stream")
    outs = await finished(ctx, streams, timers)
    return JSONResponse(answer([(kind, out.outputs[0]) for kind, out in zip(types, outs)]))


async def _events(types: list[SteerType], streams: list[RequestStream], timers: list[RequestTimer],
                  answer: Answer) -> AsyncIterator[str]:
    latest: list[CompletionOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            timers[i].update(out)
            latest[i] = out.outputs[0]
            yield _event(answer(list(zip(types, latest))))
    except Exception as err:  # noqa: BLE001 -- once streaming, an error can only be a message
        yield _event(json.loads(failure(err).body))
    finally:
        close(streams, timers)


def _event(data: dict[str, Any]) -> str:
    """One SSE message, its JSON written as ``JSONResponse`` writes a body (so the last one equals it)."""
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"
