"""``AsyncLLM``: the engine steps in its own thread while asyncio code submits requests, streams
their outputs and steers or captures (vLLM's names).

The engine thread owns the engine. Everything else reaches it through one queue of calls (new
requests, aborts, control-plane changes) that the thread runs between steps, in order, so a change
applies to every request submitted after it returns, as offline. While there is work the thread
steps; otherwise it sleeps on a condition until a call arrives. Outputs go back to the event loop
once per step; a request's stream keeps only its newest cumulative output, so a slow consumer
skips intermediate states instead of queueing them.

Streaming input follows vLLM's resumable requests: ``generate`` also takes an async iterator of
prompt chunks (``StreamingInput`` or bare prompts). The first chunk starts the request; each later
one is queued and applied when the previous chunk's generation has ended, the new prompt being the
previous prompt, the tokens generated for it except the last, then the chunk. The output stream
carries every generated token of every chunk; it finishes once the iterator is exhausted and the
last chunk is done. The request keeps its steering, capture, KV blocks and prefix-cache identity
throughout; a chunk's ``sampling_params`` may change sampling only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from steerable.entrypoints.llm import LLM
from steerable.errors import EngineDeadError, InvalidRequestError
from steerable.hook_points import COMPONENTS
from steerable.inputs import parse_prompt
from steerable.outputs import CompletionOutput, RequestOutput
from steerable.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StreamingInput:
    """One chunk of a streaming-input request: text or token ids appended to the cumulative
    prompt, and optionally the sampling for the generation after it (vLLM's name)."""

    prompt: str | list[int]
    sampling_params: SamplingParams | None = None


class RequestStream:
    """One request's cumulative outputs: ``async for`` yields them up to the finished one. Closing
    the stream, or cancelling the task that waits on it, aborts an unfinished request."""

    def __init__(self, llm: "AsyncLLM", request_id: str, session: bool = False):
        self.request_id = request_id
        self._llm = llm
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._done = False
        self._session = _Session() if session else None
        self._feeder: asyncio.Task | None = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            await self._ready.wait()
        except asyncio.CancelledError:
            self.close()
            raise
        self._ready.clear()
        if self._error is not None:
            self._done = True
            raise self._error
        latest = self._newest()
        if latest.finished:
            self._done = True
        return latest

    def close(self) -> None:
        """Stop consuming; an unfinished request is aborted before the engine's next step."""
        if self._feeder is not None:
            self._feeder.cancel()
        if not self._done:
            self._done = True
            self._llm._abort_soon(self.request_id, self)

    def _put(self, out: RequestOutput) -> None:
        if self._done:
            return
        self._latest = self._session.merge(out) if self._session is not None else out
        self._ready.set()

    def _newest(self) -> RequestOutput:
        return self._latest

    def _has_finished(self) -> bool:
        """Whether the finished output has arrived (a later failure no longer concerns it)."""
        return self._latest is not None and self._latest.finished

    def _fail(self, error: BaseException) -> None:
        if not (self._done or self._has_finished() or self._error is not None):
            self._error = error
            self._ready.set()


class _Session:
    """A streaming-input request's output across chunks: each chunk's tokens, text and logprobs
    follow those of the chunks before it (the engine reports one chunk at a time)."""

    def __init__(self) -> None:
        self.done = CompletionOutput(0, "", [], logprobs=None)

    def merge(self, out: RequestOutput) -> RequestOutput:
        chunk = out.outputs[0]
        done = self.done
        logprobs = None if chunk.logprobs is None else (done.logprobs or []) + chunk.logprobs[:len(chunk.token_ids)]
        cumulative = None if chunk.cumulative_logprob is None else (done.cumulative_logprob or 0.0) + \
            chunk.cumulative_logprob
        merged = dataclasses.replace(chunk, text=done.text + chunk.text, token_ids=done.token_ids + chunk.token_ids,
                                     logprobs=logprobs, cumulative_logprob=cumulative)
        if chunk.finish_reason is not None and not out.finished:  # this chunk's generation has ended
            self.done = merged
        return dataclasses.replace(out, outputs=[merged])


class _Call:
    """A function for the engine thread and, when someone awaits it, the future for its result."""

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future | None = None):
        self.fn = fn
        self.future = future

    def run(self) -> None:
        try:
            result = self.fn()
        except Exception as err:  # reported to the caller; the engine stays up
            if self.future is None:
                logger.exception("engine call failed")
            self.fail(err)
        else:
            if self.future is not None:
                _post(self.future.get_loop(), _resolve, self.future, result, None)

    def fail(self, error: BaseException) -> None:
        if self.future is not None:
            _post(self.future.get_loop(), _resolve, self.future, None, error)


class AsyncLLM:
    """``LLM`` for asyncio (same constructor arguments): ``generate`` streams cumulative outputs,
    many concurrent requests batch together, and every control-plane call of ``LLM`` is awaitable."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._llm = LLM(*args, **kwargs)
        self.engine = self._llm.engine
        self._wake = threading.Condition()
        self._calls: list[_Call] = []
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._routes: dict[str, RequestStream] = {}  # engine thread only: where each request's outputs go
        self._thread = threading.Thread(target=self._run, name="steerable-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ requests

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last with ``finished=True``. ``prompt`` is one
        prompt in any form ``LLM.generate`` takes, or an async iterator of chunks (streaming input)."""
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_request(self, request_id: str, prompt: Any,
                          sampling_params: SamplingParams | None = None) -> RequestStream:
        """Admit one request and return its stream; bad input raises here (``InvalidRequestError``),
        before any output, so a server can answer 400 before it starts streaming."""
        if hasattr(prompt, "__aiter__"):
            return await self._add_session(request_id, prompt, sampling_params)
        stream = self._stream(request_id)
        await self._admit_soon(stream, parse_prompt(prompt), sampling_params, resumable=False)
        return stream

    async def abort(self, request_id: str) -> None:
        """Abort a request: its KV blocks, steering rows and capture state are freed before the next
        step, and its stream ends with ``finish_reason="abort"``."""
        await self._call(functools.partial(self._abort, request_id, None))

    async def stats(self) -> dict[str, Any]:
        """``LLMEngine.stats()``, read between steps."""
        return await self._call(self.engine.stats)

    async def _control(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``LLM.<name>(*args, **kwargs)`` between steps."""
        return await self._call(functools.partial(getattr(self._llm, name), *args, **kwargs))

    @property
    def dtype(self) -> Any:
        """The model's activation dtype (a ``torch.dtype``)."""
        return self.engine.dtype

    def capture_layouts(self) -> dict[str, dict[str, Any]]:
        """``capture_status`` of every component the model offers, read at start (the layouts do
        not change): what a server advertises and sizes captures by."""
        return capture_layouts(self.engine)

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer wrapper (``encode``, ``decode``, ``apply_chat_template``, ``hf``)."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV cache holds (every live sequence's together): what a server bounds
        ``n`` x prompt and ``n`` x ``max_tokens`` by."""
        return self.engine.kv_capacity

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine takes no more work (shut down, or a step failed); None while it runs."""
        return self._dead

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the engine thread (open streams end with ``EngineDeadError``), then free the engine
        as ``LLM.shutdown`` does. Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._llm.shutdown()

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------ streaming input

    async def _add_session(self, request_id: str, chunks: Any, params: SamplingParams | None) -> RequestStream:
        iterator = chunks.__aiter__()
        try:
            first = _as_chunk(await iterator.__anext__())
        except StopAsyncIteration:
            raise InvalidRequestError("prompt: the streaming input ended before its first chunk") from None
        stream = self._stream(request_id, session=True)
        await self._admit_soon(stream, first.prompt, first.sampling_params or params, resumable=True)
        stream._feeder = asyncio.ensure_future(self._feed(stream, iterator, params))
        return stream

    async def _feed(self, stream: RequestStream, iterator: Any, params: SamplingParams | None) -> None:
        """Hand the chunks to the engine as they come (a chunk without sampling parameters takes
        ``params``, those ``generate`` was given), then close the input."""
        rid = stream.request_id
        try:
            async for item in iterator:
                chunk = _as_chunk(item)
                await self._extend(rid, chunk.prompt, chunk.sampling_params or params)
            await self._end_input(rid)
        except Exception as err:  # a bad chunk, or the iterator raised: the request ends with it
            self._abort_soon(rid, stream)
            stream._fail(err)

    def _stream(self, request_id: str, session: bool = False) -> RequestStream:
        """A new request's stream (from the event loop that will consume it)."""
        return RequestStream(self, request_id, session)

    async def _extend(self, request_id: str, prompt: Any, params: SamplingParams | None) -> None:
        await self._call(functools.partial(self.engine.extend_request, request_id, prompt, params))

    async def _end_input(self, request_id: str) -> None:
        await self._call(functools.partial(self._close_input, request_id))

    def _close_input(self, request_id: str) -> None:
        self._deliver(self.engine.close_request_input(request_id))

    # ------------------------------------------------------------ calls into the engine thread

    async def _admit_soon(self, stream: RequestStream, prompt: Any, params: SamplingParams | None,
                          resumable: bool) -> None:
        try:
            await self._call(functools.partial(self._admit, stream, prompt, params, resumable))
        except asyncio.CancelledError:  # admitted or not, nobody will consume it
            self._abort_soon(stream.request_id, stream)
            raise

    def _admit(self, stream: RequestStream, prompt: Any, params: SamplingParams | None, resumable: bool) -> None:
        self.engine.add_request(stream.request_id, prompt, params, stream=True, resumable=resumable)
        self._routes[stream.request_id] = stream

    def _abort(self, request_id: str, stream: RequestStream | None) -> None:
        """Abort ``request_id`` if it still runs (for ``stream``, when given, and no later namesake)."""
        route = self._routes.get(request_id)
        if route is not None and (stream is None or route is stream):
            self._deliver(self.engine.abort_request(request_id))

    def _abort_soon(self, request_id: str, stream: RequestStream) -> None:
        """Abort without waiting (from a cancelled task or a closed stream)."""
        try:
            self._submit(_Call(functools.partial(self._abort, request_id, stream)))
        except EngineDeadError:
            pass  # the engine is gone, and the request with it

    async def _call(self, fn: Callable[[], Any]) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._submit(_Call(fn, future))
        return await future

    def _submit(self, call: _Call) -> None:
        with self._wake:
            if self._dead is not None or self._closing:
                raise self._dead or EngineDeadError("AsyncLLM is shutting down")
            self._calls.append(call)
            self._wake.notify()

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        """Run queued calls, then a step while there is work; sleep when there is none, or when two
        steps in a row did nothing (every request waits for memory that only a call can free)."""
        engine = self.engine
        idle = 0
        try:
            while True:
                with self._wake:
                    while not (self._calls or self._closing) and (idle >= 2 or not engine.has_unfinished_requests()):
                        self._wake.wait()
                    if self._closing:
                        break
                    calls, self._calls = self._calls, []
                if calls:
                    idle = 0
                for call in calls:
                    call.run()
                if engine.has_unfinished_requests():
                    steps = engine.num_steps
                    outputs = engine.step()
                    self._deliver(outputs)
                    idle = 0 if outputs or engine.num_steps != steps else idle + 1
            self._stop(EngineDeadError("AsyncLLM is shut down"))
        except BaseException as err:
            logger.exception("the engine thread failed")
            self._stop(EngineDeadError(f"the engine failed: {err!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams: one hand-off per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._routes.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            batches.setdefault(stream._loop, []).append((stream, out))
        for loop, batch in batches.items():
            _post(loop, _put_all, batch)

    def _stop(self, error: EngineDeadError) -> None:
        """No more work: pending calls and open streams fail with ``error``."""
        with self._wake:
            self._dead = error
            calls, self._calls = self._calls, []
        for call in calls:
            call.fail(error)
        for stream in self._routes.values():
            _post(stream._loop, stream._fail, error)
        self._routes.clear()


_CONTROL_PLANE = ("set_steering_vectors", "clear_steering_vectors", "register_steering_modules",
                  "unregister_steering_modules", "get_steering_module", "list_steerable_layers", "get_steering_status",
                  "start_capture", "stop_capture", "fetch_captured", "clear_captured", "capture_status",
                  "add_capture_consumer", "remove_capture_consumer", "register_sae", "list_saes", "get_sae",
                  "unregister_sae")


def _awaitable(name: str) -> Callable[..., Any]:
    """``LLM.<name>`` run on the engine thread between steps, awaited."""

    @functools.wraps(getattr(LLM, name))
    async def call(self: AsyncLLM, *args: Any, **kwargs: Any) -> Any:
        return await self._control(name, args, kwargs)

    return call


for _name in _CONTROL_PLANE:
    setattr(AsyncLLM, _name, _awaitable(_name))
# LLM's arguments, which AsyncLLM passes on: help(AsyncLLM) and IDEs show them, not (*args, **kwargs).
AsyncLLM.__init__.__signature__ = inspect.signature(LLM.__init__)


def capture_layouts(engine: Any) -> dict[str, dict[str, Any]]:
    """``engine.capture_status`` of each capture component the model has hook points for."""
    layouts = {}
    for component in COMPONENTS:
        try:
            layouts[component] = engine.capture_status(component)
        except ValueError:  # the model has no such hook points (router logits of a dense model)
            continue
    return layouts


def _as_chunk(item: Any) -> StreamingInput:
    if isinstance(item, StreamingInput):
        return item
    if isinstance(item, (str, list)):
        return StreamingInput(item)
    raise InvalidRequestError(f"prompt: a streaming-input chunk is a StreamingInput, text or token ids, "
                              f"got {type(item).__name__}")


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn`` on ``loop``; a loop that has closed meanwhile has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream._put(out)
