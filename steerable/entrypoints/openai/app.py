"""The app factory: routes, error handlers, the body-size limit, error counting, and running it
under uvicorn. Further route modules (e.g. control vectors) plug in through ``ROUTERS``."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline

import steerable
from steerable.entrypoints.async_llm import AsyncLLM
from steerable.entrypoints.openai import admin, auth, chat, completions, info, invocations, playground, saes, vectors
from steerable.entrypoints.openai.auth import Keys
from steerable.entrypoints.openai.errors import error_body, install_error_handlers
from steerable.entrypoints.openai.extensions import CaptureInfo
from steerable.entrypoints.openai.metrics import Metrics
from steerable.entrypoints.openai.state import ServerSettings, ServerState
from steerable.entrypoints.heap import freeze_startup_heap

ROUTERS = [info.open_router, info.router, auth.router, completions.router, chat.router, invocations.router,
           admin.user, admin.admin, vectors.user, vectors.admin, saes.user, saes.admin, playground.router]

Scope = dict[str, Any]


def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """A FastAPI app serving ``llm``; the caller runs it and shuts ``llm`` down afterwards."""
    # /docs and /redoc with their scripts served from the package, not a CDN: they work offline.
    app = FastAPIOffline(title="steerable", version=steerable.__version__)
    metrics = Metrics()
    app.state.server = ServerState(llm, settings, Keys(settings.api_keys, settings.admin_api_key), metrics,
                                   capture_info(llm), int(time.time()))
    for router in ROUTERS:
        app.include_router(router)
    if settings.neuronpedia:
        # Imported here: the package builds on this one's modules, whose package imports this module.
        from steerable.entrypoints.neuronpedia import mount

        mount(app, settings.neuronpedia_source_sets)
    playground.mount_static(app)
    install_error_handlers(app)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(_ErrorCounter, metrics=metrics)  # outermost: it sees the body limit's 413s too
    return app


def capture_info(llm: AsyncLLM) -> CaptureInfo:
    """Capturable layers and widths per component (read once; the model does not change)."""
    layers, widths, layouts = {}, {}, {}
    for component, status in llm.capture_layouts().items():
        layers[component] = status["hooked_layers"]
        layouts[component] = status["layouts"]
        widths[component] = next(iter(status["layouts"].values()))["width"]
    return CaptureInfo(layers, widths, layouts, llm.dtype)


# The thread that feeds the streams (the reader of the engine process's pipe under `steerable
# serve`, the engine thread itself with an in-process AsyncLLM) waits without the GIL and must get
# it back at once; the event loop, busy with many streams, would otherwise keep it for the default
# 5 ms, and an unread pipe stalls the engine. In a simulation of a saturated GPU engine on a thread
# (10 ms steps, 256 streams) the engine kept 84 % of its step rate at 5 ms, 95 % at 0.5 ms and 98 %
# at 0.2 ms.
GIL_SWITCH_INTERVAL_S = 0.0002


def run_server(app: FastAPI, listener: socket.socket, log_level: str = "info") -> None:
    """Serve on ``listener`` (bound and listening) until SIGINT/SIGTERM; requests in flight get a
    few seconds to finish. Below ``debug`` uvicorn's own start and stop lines are left out: the
    caller says where it serves and when it stopped, one line each."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off")
    if log_level != "debug":
        logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLevelName(log_level.upper())))
    freeze_startup_heap()
    # uvicorn shuts down on the signal, then raises it again for the handler it found: ours ends
    # the run like any return (Python's would print a KeyboardInterrupt traceback for Ctrl-C, and
    # SIGTERM's default would kill the process before the engine is shut down).
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[listener])
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Stopped(Exception):
    """SIGINT or SIGTERM, once uvicorn has shut down."""


def _stopped(signum: int, frame: Any) -> None:
    raise _Stopped()


class _BodyLimit:
    """413 for a body over ``--max-body-bytes``, declared or streamed, before any parsing."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client left while sending
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect, as the server's would
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Any, send: Any) -> None:
        body = error_body(413, f"body: larger than --max-body-bytes={self.limit}", "body")
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _ErrorCounter:
    """``steerable:request_errors_total`` by status, for every answer with a status >= 400."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        async def counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.error(message["status"])
            await send(message)

        await self.app(scope, receive, counted if scope["type"] == "http" else send)
