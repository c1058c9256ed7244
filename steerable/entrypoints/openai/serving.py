"""The flow completions and chat share: tokenized prompts in, engine requests admitted (a 400
comes before any output), then either one JSON answer or server-sent events, each choice
streamed as deltas of the engine's cumulative outputs. A client that disconnects has its requests
aborted: a stream is cancelled by Starlette, a plain request by a watcher on the connection."""

from __future__ import annotations

import abc
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from steerable.entrypoints.async_llm import RequestStream
from steerable.entrypoints.openai.errors import APIError, ClientDisconnected, classify, error_body
from steerable.entrypoints.openai.limits import check_kv_fit
from steerable.entrypoints.openai.metrics import RequestTimer
from steerable.entrypoints.openai.protocol import GenerationRequest
from steerable.entrypoints.openai.state import ServerState
from steerable.errors import InvalidRequestError
from steerable.outputs import CompletionOutput, Logprob, RequestOutput
from steerable.sampling_params import SamplingParams


@dataclass
class ChoiceState:
    """How much of one choice a stream has sent."""

    chars: int = 0
    tokens: int = 0
    started: bool = False  # its first chunk is out (it carries the prompt's fields)
    finished: bool = False


class Generation(abc.ABC):
    """One completions or chat request; subclasses say how prompts are made and choices look."""

    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"
    prompt_fields_on_choice = True  # vLLM: completions choices carry the prompt's ids and logprobs, chat answers do

    def __init__(self, state: ServerState, body: GenerationRequest, request: Request):
        self.state = state
        self.body = body
        self.request = request
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    # ------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def tokenized_prompts(self) -> list[list[int]]:
        """The prompts as token ids (chat: the conversation through the chat template)."""

    @abc.abstractmethod
    def default_max_tokens(self, prompt_len: int) -> int:
        """``max_tokens`` when the request gives none."""

    def requested_max_tokens(self) -> int | None:
        return self.body.max_tokens

    @abc.abstractmethod
    def logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` from the request's own logprobs fields."""

    def prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` the request's form needs beyond its own field."""
        return None

    @abc.abstractmethod
    def choice(self, index: int, completion: CompletionOutput, out: RequestOutput) -> dict[str, Any]:
        """A finished choice of the non-streaming answer."""

    @abc.abstractmethod
    def delta(self, index: int, text: str, completion: CompletionOutput, start: int, out: RequestOutput,
              may_skip: bool) -> dict[str, Any] | None:
        """One choice's part of a stream chunk: ``text`` is new since the last one, tokens from
        ``start``. None (only when ``may_skip``: nothing else is due) when nothing of it can be
        shown yet (a parser holds it back)."""

    def finish_reason(self, index: int, completion: CompletionOutput) -> str | None:
        """A finished choice's ``finish_reason`` (chat: ``tool_calls`` where it called tools)."""
        return completion.finish_reason

    def opening(self) -> list[list[dict[str, Any]]]:
        """The choices of the chunks sent before any output (chat: each choice's role)."""
        return []

    def opening_fields(self) -> dict[str, Any]:
        """Top-level fields of each opening chunk (chat: the prompt's token ids)."""
        return {}

    # ------------------------------------------------------------ the flow

    async def respond(self) -> Response:
        body = self.body
        body.check()
        self.state.check_model(body.model)
        self.prompts = [self._truncated(prompt) for prompt in self.tokenized_prompts()]
        self.params = [self._params(prompt) for prompt in self.prompts]
        self._check_capture_size()
        streams = await self._submit()
        timers = [RequestTimer(self.state.metrics) for _ in streams]
        if body.stream:
            return StreamingResponse(self._events(streams, timers), media_type="text/event-stream")
        outputs = await until_disconnect(self.request, self._collect(streams, timers))
        return JSONResponse(self._response(outputs))

    def _truncated(self, prompt: list[int]) -> list[int]:
        """``truncate_prompt_tokens``: the last (``truncation_side='left'``) or first k tokens; -1: as
        many as ``max_model_len`` leaves room for."""
        keep = self.body.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.state.llm.max_model_len - 1
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens: must be >= 1 or -1, got {keep}")
        if len(prompt) <= keep:
            return prompt
        return prompt[len(prompt) - keep:] if self.body.truncation_side == "left" else prompt[:keep]

    def token_name(self, token: int, logprob: Logprob) -> str:
        """A logprob entry's token as the client asked: ``token_id:N`` or its text."""
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{token}"
        return logprob.decoded_token or ""

    def prompt_logprobs_json(self, out_prompt_logprobs: list | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``{id: {logprob, rank, decoded_token}}``, the first null."""
        if out_prompt_logprobs is None or self.body.prompt_logprobs is None:
            return None
        return [None if entries is None else
                {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.token_name(t, lp)}
                 for t, lp in entries.items()} for entries in out_prompt_logprobs]

    def _params(self, prompt: list[int]) -> SamplingParams:
        limit = self.state.llm.max_model_len
        if len(prompt) >= limit:
            raise InvalidRequestError(f"prompt: {len(prompt)} tokens leave no room to generate within "
                                      f"max_model_len={limit}")
        max_tokens = self.requested_max_tokens()
        check_kv_fit(self.body.n, len(prompt), max_tokens, self.state.llm.kv_capacity)
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(prompt))
        elif max_tokens > 0 and len(prompt) + max_tokens > limit:
            raise InvalidRequestError(f"max_tokens: {max_tokens} plus the prompt's {len(prompt)} tokens exceed "
                                      f"max_model_len={limit}")
        return self.body.sampling_params(max_tokens, self.logprobs(), self.prompt_logprobs())

    def _check_capture_size(self) -> None:
        """400 before anything runs: the captures this answer could carry exceed ``--max-capture-bytes``
        (a parameter over a limit, as OpenAI and vLLM answer it; 413 stays the body's size)."""
        limit = self.state.settings.max_capture_bytes
        info = self.state.capture
        bound = sum(info.bytes_bound(p.capture, prompt, p.max_tokens) * p.n
                    for prompt, p in zip(self.prompts, self.params))
        if bound > limit:
            raise APIError(400, f"capture: this answer could carry {bound} bytes of captures, over "
                                f"--max-capture-bytes={limit}; capture fewer rows or layers (select, reduce, "
                                "budget_rows), or record them with a capture stream (/v1/capture/streams) or a "
                                "consumer", "capture")

    async def _submit(self) -> list[RequestStream]:
        llm = self.state.llm
        ids = [self.id] if len(self.prompts) == 1 else [f"{self.id}-{i}" for i in range(len(self.prompts))]
        results = await asyncio.gather(*[llm.add_request(rid, prompt, params) for rid, prompt, params
                                         in zip(ids, self.prompts, self.params)], return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in results:
                if isinstance(stream, RequestStream):
                    stream.close()
            raise errors[0]
        return results

    async def _collect(self, streams: list[RequestStream], timers: list[RequestTimer]) -> list[RequestOutput]:
        async def last(stream: RequestStream, timer: RequestTimer) -> RequestOutput:
            async for out in stream:
                timer.update(out)
            return out

        try:
            return await asyncio.gather(*[last(s, t) for s, t in zip(streams, timers)])
        finally:
            _close(streams, timers)

    async def _events(self, streams: list[RequestStream], timers: list[RequestTimer]) -> AsyncIterator[str]:
        """Server-sent events; an error after the first event arrives as a ``data:`` error object."""
        states: dict[tuple[int, int], ChoiceState] = {}
        try:
            for choices in self.opening():
                yield _event({**self._stream_chunk(choices, timers), **self.opening_fields()})
            async for i, out in merge_streams(streams):
                timers[i].update(out)
                for choice in self._deltas(i, out, states):  # one choice per chunk, as vLLM sends them
                    yield _event(self._stream_chunk([choice], timers))
            if self.body.include_usage:
                yield _event({**self._chunk([]), "usage": self._usage([t.last for t in timers], details=True)})
        except Exception as err:
            status, message, param = classify(err)
            self.state.metrics.error(status)
            yield _event(error_body(status, message, param))
        finally:
            _close(streams, timers)
        yield "data: [DONE]\n\n"

    def _deltas(self, i: int, out: RequestOutput, states: dict[tuple[int, int], ChoiceState]) -> list[dict]:
        """What each choice of prompt ``i`` gained since the last event. While a choice runs, text that
        could begin a stop string is held back (it disappears if the stop string completes)."""
        choices = []
        stops = self.params[i].stop_strings
        hold = max(map(len, stops)) - 1 if stops else 0
        for completion in out.outputs:
            state = states.setdefault((i, completion.index), ChoiceState())
            finished = completion.finish_reason is not None
            if state.finished:
                continue
            end = len(completion.text) if finished else max(state.chars, len(completion.text) - hold)
            tokens = len(completion.token_ids)
            # New tokens are news even without new text when the client asked for their ids or logprobs.
            token_news = tokens > state.tokens and (completion.logprobs is not None or self.body.return_token_ids)
            if end == state.chars and not token_news and not finished:
                continue
            index = i * self.body.n + completion.index
            choice = self.delta(index, completion.text[state.chars:end], completion, state.tokens, out,
                                may_skip=not token_news and not finished)
            if choice is None:
                state.chars, state.tokens = end, tokens
                continue
            if self.body.return_token_ids:  # in a stream, each chunk's new tokens
                choice["token_ids"] = completion.token_ids[state.tokens:tokens]
            if not state.started and self.prompt_fields_on_choice:  # vLLM: on a choice's first chunk
                if self.body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs)
                if self.body.return_token_ids:
                    choice["prompt_token_ids"] = self.prompts[i]
            state.chars, state.tokens, state.started, state.finished = end, tokens, True, finished
            if finished:
                choice.update(self._final_fields(completion, i, index, whole=False))
            choices.append(choice)
        return choices

    def _final_fields(self, completion: CompletionOutput, i: int, index: int, whole: bool = True) -> dict[str, Any]:
        """What a finished choice adds: why it ended, its captures, and (``whole``: not streamed) its tokens."""
        fields: dict[str, Any] = {"finish_reason": self.finish_reason(index, completion),
                                  "stop_reason": completion.stop_reason}
        if completion.captures:
            fields["captures"] = self.state.capture.to_json(completion)
        if not whole:
            return fields
        fields["token_ids"] = list(completion.token_ids) if self.body.return_token_ids else None
        if self.prompt_fields_on_choice:
            fields["prompt_token_ids"] = self.prompts[i] if self.body.return_token_ids else None
        return fields

    def _stream_chunk(self, choices: list[dict], timers: list[RequestTimer]) -> dict[str, Any]:
        """A stream chunk; with ``continuous_usage_stats`` it carries the usage so far."""
        chunk = self._chunk(choices)
        if self.body.continuous_usage:
            chunk["usage"] = self._usage([t.last for t in timers])
        return chunk

    def _chunk(self, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.state.settings.served_model_name, "choices": choices}

    def _response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        n = self.body.n
        choices = [{**self.choice(i * n + c.index, c, out), **self._final_fields(c, i, i * n + c.index)}
                   for i, out in enumerate(outputs) for c in out.outputs]
        # The fields vLLM always serialises, null where unused, so model_dump()s compare equal.
        answer = {"id": self.id, "object": self.object_name, "created": self.created,
                  "model": self.state.settings.served_model_name, "choices": choices, "service_tier": None,
                  "system_fingerprint": None, "usage": self._usage(outputs, details=True),
                  "kv_transfer_params": None}
        if self.prompt_fields_on_choice:
            for choice, out in zip(choices, [out for out in outputs for _ in out.outputs]):
                choice["prompt_logprobs"] = self.prompt_logprobs_json(out.prompt_logprobs)
        else:  # one prompt
            answer["prompt_logprobs"] = self.prompt_logprobs_json(outputs[0].prompt_logprobs)
            answer["prompt_token_ids"] = self.prompts[0] if self.body.return_token_ids else None
        return answer

    def _usage(self, outputs: list[RequestOutput | None], details: bool = False) -> dict[str, Any]:
        """Token counts; ``details`` (an answer's or a stream's last usage): with
        ``--enable-prompt-tokens-details``, the prompt tokens the prefix cache served."""
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                                 "completion_tokens": completion}
        if details:
            usage["prompt_tokens_details"] = None
            if self.state.settings.enable_prompt_tokens_details:
                cached = sum(out.num_cached_tokens or 0 for out in outputs if out is not None)
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage


# ---------------------------------------------------------------- logprobs, both formats

def token_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int
                   ) -> list[tuple[int, Logprob, list[tuple[int, Logprob]]]]:
    """(token, its logprob, alternatives) for tokens with logprob entries. The alternatives are
    vLLM's order: the token itself first, then the ``top`` most likely others by rank (so k + 1
    entries when the token is not among the top k); a format that shows k entries shows the
    first k."""
    out = []
    for token, entries in zip(token_ids, logprobs):
        others = sorted(((t, lp) for t, lp in entries.items() if t != token and lp.rank <= top),
                        key=lambda kv: kv[1].rank)
        out.append((token, entries[token], [(token, entries[token]), *others]))
    return out


# ---------------------------------------------------------------- helpers

async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (its
    streams abort their requests) and ``ClientDisconnected`` is raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its streams abort their requests on the way out
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as err:
            queue.put_nowait((i, None, err))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()


def _close(streams: list[RequestStream], timers: list[RequestTimer]) -> None:
    for stream in streams:
        stream.close()
    for timer in timers:
        timer.finish()


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
