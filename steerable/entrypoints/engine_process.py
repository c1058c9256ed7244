"""``ProcessAsyncLLM``: ``AsyncLLM`` with the engine in a process of its own (vLLM's engine core).

A server streaming hundreds of requests spends as much Python time per step on HTTP (one SSE chunk
per request per token) as the engine spends scheduling and emitting. In one process both share one
GIL, and the engine's steps stretch towards the sum (on an H200, 256 streams ran at 0.41-0.64x the
offline rate; 0.75x with the engine here, ``docs/benchmarks.md``). In its own process the engine
never waits for HTTP work: a busy event loop only means that each stream's chunks carry several
tokens, because a stream keeps just its newest cumulative output.

The protocol is one duplex pipe between this process and the engine's, carrying our own objects
(requests the server has already validated and parsed, outputs, control-plane calls and their
results), never a client's bytes:

- to the engine: ``("call", id, op, args)``, answered by ``("result", id, value, error)`` unless
  ``id`` is None, and ``("shutdown",)``;
- from the engine: ``("outputs", [increment])``, each output what is new since the last (the
  engine builds them: ``OutputProcessor.increment``; ``output_codec`` decodes them here), and
  ``("dead", message)`` when a step failed. A thread of the engine process sends them, so a step
  never waits for this process to read: outputs of steps that queued meanwhile leave together, one
  increment per request.

Calls run between steps in the order sent, as on ``AsyncLLM``'s engine thread. An abort names the
stream it comes from, so a late abort never reaches a later request that reuses the id.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from typing import Any

from steerable.entrypoints.async_llm import AsyncLLM, RequestStream, _post, _put_all, _resolve, capture_layouts
from steerable.entrypoints.output_codec import OutputDecoder, merge_increments
from steerable.errors import EngineDeadError
from steerable.entrypoints.heap import freeze_startup_heap
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ProcessAsyncLLM(AsyncLLM):
    """``AsyncLLM(*args, **kwargs)`` whose engine runs in a spawned child process. Everything but
    Python callables crosses the process boundary: capture consumers (functions) are refused."""

    def __init__(self, *args: Any, **kwargs: Any):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._proc = context.Process(target=_engine_main, args=(child, args, kwargs), name="steerable-engine")
        self._proc.start()
        child.close()
        self._info = self._wait_ready()
        self._send_lock = threading.Lock()
        self._routes_lock = threading.Lock()
        self._routes: dict[str, RequestStream] = {}  # guarded by _routes_lock
        self._pending: dict[int, tuple[asyncio.Future, Any]] = {}  # guarded by _send_lock
        self._call_ids = itertools.count()
        self._stream_keys = itertools.count(1)
        self._closing = False
        self._dead: EngineDeadError | None = None
        self._reader = threading.Thread(target=self._read, name="steerable-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self) -> dict[str, Any]:
        """The engine's description once its ``LLM`` is built; its error if that failed."""
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise EngineDeadError(f"the engine process {self._exit_description()} while loading")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise EngineDeadError(f"the engine process {self._exit_description()} while loading") from None
        if kind == "failed":
            self._proc.join(30)
            raise payload
        return payload

    # ------------------------------------------------------------ what the engine told us at start

    @property
    def tokenizer(self) -> Any:
        return self._info["tokenizer"]

    def get_tokenizer(self) -> Any:
        return self._info["tokenizer"].hf

    @property
    def model_config(self) -> Any:
        return self._info["model_config"]

    @property
    def max_model_len(self) -> int:
        return self._info["max_model_len"]

    @property
    def kv_capacity(self) -> int:
        return self._info["kv_capacity"]

    @property
    def dtype(self) -> Any:
        return self._info["dtype"]

    def capture_layouts(self) -> dict[str, dict[str, Any]]:
        return self._info["capture_layouts"]

    # ------------------------------------------------------------ calls into the engine process

    async def stats(self) -> dict[str, Any]:
        return await self._request("stats")

    async def abort(self, request_id: str) -> None:
        await self._request("abort", request_id)

    async def _control(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if name == "add_capture_consumer":
            raise ValueError("consumer: capture consumers are Python functions and cannot reach an engine in "
                             "another process; use a capture stream and fetch_captured")
        return await self._request("control", name, args, kwargs)

    async def _admit_soon(self, stream: RequestStream, prompt: Any, params: SamplingParams | None,
                          resumable: bool) -> None:
        stream._key = next(self._stream_keys)

        def route() -> None:  # on the reader thread, before any output of the request can arrive
            with self._routes_lock:
                self._routes[stream.request_id] = stream

        try:
            await self._request("admit", stream.request_id, stream._key, prompt, params, resumable, on_ok=route)
        except asyncio.CancelledError:  # admitted or not, nobody will consume it
            self._abort_soon(stream.request_id, stream)
            raise

    def _abort_soon(self, request_id: str, stream: RequestStream) -> None:
        try:
            self._send(None, "abort", (request_id, stream._key))
        except EngineDeadError:
            pass  # the engine is gone, and the request with it

    async def _extend(self, request_id: str, prompt: Any, params: SamplingParams | None) -> None:
        await self._request("extend", request_id, prompt, params)

    async def _end_input(self, request_id: str) -> None:
        await self._request("close_input", request_id)

    async def _request(self, op: str, *args: Any, on_ok: Any = None) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._send((future, on_ok), op, args)
        return await future

    def _send(self, pending: tuple[asyncio.Future, Any] | None, op: str, args: tuple) -> None:
        with self._send_lock:
            if self._dead is not None or self._closing:
                raise self._dead or EngineDeadError("AsyncLLM is shutting down")
            call_id = None
            if pending is not None:
                call_id = next(self._call_ids)
                self._pending[call_id] = pending
            try:
                self._conn.send(("call", call_id, op, args))
            except (OSError, ValueError) as err:  # the pipe is gone: the engine died
                self._pending.pop(call_id, None)
                raise EngineDeadError(f"the engine process is gone: {err!r}") from err

    # ------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        """Outputs to their streams and results to their callers, in the order the engine sent them."""
        error = EngineDeadError("AsyncLLM is shut down")
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "outputs":
                    self._deliver(message[1])
                elif message[0] == "result":
                    self._finish_call(*message[1:])
                else:  # "dead"
                    error = EngineDeadError(message[1])
                    break
        except (EOFError, OSError):
            if not self._closing:
                error = EngineDeadError(f"the engine process {self._exit_description()}")
        self._stop(error)

    def _exit_description(self, timeout: float = 5.0) -> str:
        """How the engine process ended ("was killed by signal 9 (SIGKILL)", "exited with code 1"),
        once it is reaped: its pipe closes a moment before the process is gone."""
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            return "closed its pipe and is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            return f"was killed by signal {-code} ({name})"
        return f"exited with code {code}"

    def _finish_call(self, call_id: int, value: Any, error: BaseException | None) -> None:
        with self._send_lock:
            future, on_ok = self._pending.pop(call_id)
        if error is None and on_ok is not None:
            on_ok()
        _post(future.get_loop(), _resolve, future, value, error)

    def _deliver(self, increments: list[tuple]) -> None:
        """Route increments to their streams, one hand-off per event loop; the streams rebuild them."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, tuple]]] = {}
        with self._routes_lock:
            for increment in increments:
                rid, finished = increment[0], increment[1]
                stream = self._routes.get(rid)
                if stream is None:
                    continue
                if finished:
                    del self._routes[rid]
                batches.setdefault(stream._loop, []).append((stream, increment))
        for loop, batch in batches.items():
            _post(loop, _put_all, batch)

    def _stream(self, request_id: str, session: bool = False) -> RequestStream:
        return _IncrementStream(self, request_id, session)

    def _stop(self, error: EngineDeadError) -> None:
        with self._send_lock:
            self._dead = error
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            _post(future.get_loop(), _resolve, future, None, error)
        with self._routes_lock:
            routes, self._routes = self._routes, {}
        for stream in routes.values():
            _post(stream._loop, stream._fail, error)

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the engine process (open streams end with ``EngineDeadError``) and wait for it and
        its own workers to exit. Idempotent."""
        with self._send_lock:
            first = not self._closing
            self._closing = True
            if first and self._dead is None:
                try:
                    self._conn.send(("shutdown",))
                except (OSError, ValueError):
                    pass
        self._proc.join(60)
        if self._proc.is_alive():
            logger.error("the engine process ignored shutdown; killing it")
            self._proc.kill()
            self._proc.join(30)
        if threading.current_thread() is not self._reader:
            self._reader.join(30)
        self._conn.close()


ProcessAsyncLLM.__init__.__signature__ = inspect.signature(AsyncLLM.__init__)  # LLM's arguments, passed on


class _IncrementStream(RequestStream):
    """A stream fed the engine's increments. They fold as they come (O(new tokens)), and become a
    cumulative output (O(length)) only when the consumer takes one, so a consumer that falls
    behind the engine pays once for the steps it skipped (``benchmarks/output_codec.py``'s fold
    records on a 2-core CPU, 256 requests: 2.9 ms per step rebuilt every step, 2.1 ms taken every
    other step). A streaming-input
    request's increments are rebuilt as they come: each chunk's end must reach its session."""

    def __init__(self, llm: AsyncLLM, request_id: str, session: bool = False):
        super().__init__(llm, request_id, session)
        self._decoder = OutputDecoder()
        self._folded: tuple | None = None  # increments not yet rebuilt

    def _put(self, increment: tuple) -> None:
        if self._done:
            return
        if self._session is not None:
            super()._put(self._decoder.decode(increment))
            return
        self._folded = increment if self._folded is None else merge_increments(self._folded, increment)
        self._ready.set()

    def _newest(self) -> RequestOutput:
        if self._folded is not None:
            self._latest = self._decoder.decode(self._folded)
            self._folded = None
        return self._latest

    def _has_finished(self) -> bool:
        return (self._folded is not None and self._folded[1]) or super()._has_finished()


# ---------------------------------------------------------------- the engine process

def _engine_main(conn: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """The child: build the engine, describe it, then serve calls and step until told to stop or
    the parent's end of the pipe closes (a parent that died takes its engine with it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent decides
    from steerable.entrypoints.llm import LLM

    try:
        llm = LLM(*args, **kwargs)
    except BaseException as err:
        conn.send(("failed", _portable(err)))
        return
    sender = _Sender(conn)
    try:
        core = _EngineCore(llm, sender)
        freeze_startup_heap()
        sender.send(("ready", core.describe()))
        core.run(conn)
    finally:
        sender.close()
        llm.shutdown()


class _Sender:
    """Sends the engine's messages in order from a thread of its own. While one send waits for the
    parent to read, later messages queue; consecutive outputs among them leave as one message,
    each request's increments folded into one (streaming-input requests' outputs stay apart: each
    may end a chunk)."""

    _CLOSE = object()

    def __init__(self, conn: Any):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="steerable-engine-sender", daemon=True)
        self.thread.start()

    def send(self, message: tuple) -> None:
        self.queue.put(message)

    def send_outputs(self, outputs: list[tuple[tuple, bool]]) -> None:
        """``(increment, mergeable)`` pairs of one step."""
        self.queue.put(("outputs", outputs))

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop."""
        self.queue.put(self._CLOSE)
        self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                messages = [self.queue.get()]
                while not self.queue.empty():
                    messages.append(self.queue.get())
                outputs: list[tuple] = []
                where: dict[str, int] = {}
                for message in messages:
                    if message is not self._CLOSE and message[0] == "outputs":
                        for increment, mergeable in message[1]:
                            rid = increment[0]
                            if rid in where:
                                outputs[where[rid]] = merge_increments(outputs[where[rid]], increment)
                                continue
                            if mergeable:
                                where[rid] = len(outputs)
                            outputs.append(increment)
                        continue
                    if outputs:
                        self.conn.send(("outputs", outputs))
                        outputs, where = [], {}
                    if message is self._CLOSE:
                        return
                    self.conn.send(message)
                if outputs:
                    self.conn.send(("outputs", outputs))
        except (OSError, ValueError):
            return  # the parent is gone; the engine loop sees the pipe close


class _EngineCore:
    """The engine side of the pipe: the loop of ``AsyncLLM``'s engine thread, with calls named
    rather than passed as functions."""

    def __init__(self, llm: Any, sender: _Sender):
        self.llm = llm
        self.engine = llm.engine
        self.sender = sender
        self.streams: dict[str, int] = {}  # running request id -> the parent stream's key
        self.resumable: set[str] = set()

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        return {"tokenizer": engine.tokenizer, "model_config": engine.model_config,
                "max_model_len": engine.max_model_len, "kv_capacity": engine.kv_capacity, "dtype": engine.dtype,
                "capture_layouts": capture_layouts(engine)}

    def run(self, conn: Any) -> None:
        """Calls from ``conn`` between steps, until the parent says stop or goes away."""
        engine = self.engine
        idle = 0
        while True:
            busy = engine.has_unfinished_requests() and idle < 2
            try:
                ready = conn.poll(0 if busy else None)
                while ready:
                    message = conn.recv()
                    if message[0] == "shutdown":
                        return
                    self.handle(*message[1:])
                    idle = 0
                    ready = conn.poll(0)
            except (EOFError, OSError):
                return  # the parent is gone
            if engine.has_unfinished_requests():
                steps = engine.num_steps
                try:
                    outputs = engine.step()
                except Exception as err:
                    logger.exception("an engine step failed")
                    self.sender.send(("dead", f"the engine failed: {err!r}"))
                    return
                self.send_outputs(outputs)
                idle = 0 if outputs or engine.num_steps != steps else idle + 1

    def handle(self, call_id: int | None, op: str, args: tuple) -> None:
        try:
            value = getattr(self, f"op_{op}")(*args)
        except Exception as err:
            if call_id is None:
                logger.exception("engine call %s failed", op)
                return
            self.sender.send(("result", call_id, None, _portable(err)))
        else:
            if call_id is not None:
                self.sender.send(("result", call_id, value, None))

    # ------------------------------------------------------------ calls

    def op_admit(self, request_id: str, key: int, prompt: Any, params: SamplingParams | None,
                 resumable: bool) -> None:
        self.engine.add_request(request_id, prompt, params, stream=True, resumable=resumable, increments=True)
        self.streams[request_id] = key
        if resumable:
            self.resumable.add(request_id)

    def op_abort(self, request_id: str, key: int | None = None) -> None:
        """Abort ``request_id`` if it runs (for the stream ``key`` only, when given)."""
        if request_id in self.streams and key in (None, self.streams[request_id]):
            self.send_outputs(self.engine.abort_request(request_id))

    def op_extend(self, request_id: str, prompt: Any, params: SamplingParams | None) -> None:
        self.engine.extend_request(request_id, prompt, params)

    def op_close_input(self, request_id: str) -> None:
        self.send_outputs(self.engine.close_request_input(request_id))

    def op_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def op_control(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.llm, name)(*args, **kwargs)

    # ------------------------------------------------------------ outputs

    def send_outputs(self, increments: list[tuple]) -> None:
        """The parent's requests' increments (a streaming-input request's never fold: each may end
        a chunk)."""
        sent = []
        for increment in increments:
            rid, finished = increment[0], increment[1]
            if rid not in self.streams:
                continue
            sent.append((increment, rid not in self.resumable))
            if finished:
                del self.streams[rid]
                self.resumable.discard(rid)
        if sent:
            self.sender.send_outputs(sent)


def _portable(err: BaseException) -> BaseException:
    """``err`` if it survives pickling (user errors keep their type), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
