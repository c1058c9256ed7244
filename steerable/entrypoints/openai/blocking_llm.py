"""The slice of ``LLM`` that ``steerable.vectors.train`` and ``evaluate`` call (``generate``,
``capture_status``, ``get_tokenizer``, ``llm_engine.model_config``), served by the server's
``AsyncLLM``. The toolkit runs in a worker thread and its requests join the engine's batches, so a
training run or a sweep shares the engine with live traffic instead of stopping it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from steerable.entrypoints.async_llm import AsyncLLM
from steerable.entrypoints.openai.errors import ClientDisconnected
from steerable.entrypoints.openai.serving import until_disconnect
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class _EngineView:
    model_config: Any


class BlockingLLM:
    """Blocking calls into an ``AsyncLLM`` from a thread other than the event loop's."""

    def __init__(self, llm: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self._llm = llm
        self._loop = loop
        self.llm_engine = _EngineView(llm.model_config)  # train reads the model's shape from it
        self._cancelled = threading.Event()
        self._running: concurrent.futures.Future | None = None

    def get_tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def capture_status(self, stream: str) -> dict[str, Any]:
        return self._wait(self._llm.capture_status(stream))

    def generate(self, prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams],
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Final outputs in prompt order; ``prompts`` is a list, as the toolkit always passes."""
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        return self._wait(self._final_outputs(list(prompts), list(params)))

    def cancel(self) -> None:
        """Abort the batch in flight; later calls raise ``ClientDisconnected``."""
        self._cancelled.set()
        running = self._running
        if running is not None:
            running.cancel()

    async def _final_outputs(self, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
        async def last(prompt: Any, p: SamplingParams) -> RequestOutput:
            async for out in self._llm.generate(prompt, p):
                pass
            return out

        tasks = [asyncio.ensure_future(last(prompt, p)) for prompt, p in zip(prompts, params)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # after a failure, the other requests are aborted rather than run out
                task.cancel()

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        if self._cancelled.is_set():
            work.close()
            raise ClientDisconnected()
        self._running = asyncio.run_coroutine_threadsafe(work, self._loop)
        try:
            return self._running.result()
        except concurrent.futures.CancelledError:
            raise ClientDisconnected() from None


async def run_blocking(request: Request, llm: AsyncLLM, fn: Callable[[BlockingLLM], T]) -> T:
    """``fn(BlockingLLM)`` in a worker thread; a client that disconnects stops it at once (its
    requests are aborted) and gets no answer."""
    view = BlockingLLM(llm, asyncio.get_running_loop())
    try:
        return await until_disconnect(request, asyncio.to_thread(fn, view))
    finally:
        view.cancel()
