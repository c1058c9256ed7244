"""Engine requests of one API call: all admitted before any output is awaited (so they run in one
batch), all aborted when one is refused, the client leaves or the call ends early."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from steerable.entrypoints.async_llm import RequestStream
from steerable.entrypoints.neuronpedia.context import Context
from steerable.entrypoints.openai.metrics import RequestTimer
from steerable.entrypoints.openai.serving import until_disconnect
from steerable.outputs import RequestOutput
from steerable.sampling_params import SamplingParams


async def submit(ctx: Context, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[RequestStream]:
    """``(name, prompt ids, params)`` each admitted as ``neuronpedia-<uuid>-<name>``; a refused one
    (bad steering, a capture over a limit) closes the others and raises."""
    base = f"neuronpedia-{uuid.uuid4().hex}"
    admitted = await asyncio.gather(*[ctx.llm.add_request(f"{base}-{name}", ids, params)
                                      for name, ids, params in requests], return_exceptions=True)
    errors = [s for s in admitted if isinstance(s, BaseException)]
    if errors:
        close([s for s in admitted if isinstance(s, RequestStream)])
        raise errors[0]
    return admitted


async def finished(ctx: Context, streams: list[RequestStream], timers: Sequence[RequestTimer] = ()
                   ) -> list[RequestOutput]:
    """Each stream's last output; a client that leaves first aborts them all."""
    async def last(i: int) -> RequestOutput:
        out = None
        async for out in streams[i]:
            if timers:
                timers[i].update(out)
        return out

    try:
        return await until_disconnect(ctx.request, asyncio.gather(*[last(i) for i in range(len(streams))]))
    finally:
        close(streams, timers)


def close(streams: Sequence[RequestStream], timers: Sequence[RequestTimer] = ()) -> None:
    """Unfinished requests are aborted; each timer counts its request once."""
    for stream in streams:
        stream.close()
    for timer in timers:
        timer.finish()
