"""The test suite's ``steerable serve``: the tiny model in a subprocess on a free loopback port
(``ServerProcess``), with both keys and small body and capture limits."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from steerable.entrypoints.openai.launcher import ServerProcess

USER_KEY, ADMIN_KEY = "user-key", "admin-key"
SERVED_NAME = "tiny"
MAX_BODY_BYTES = 2**20
MAX_CAPTURE_BYTES = 2**18
USER = {"Authorization": f"Bearer {USER_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_test_model(model: str, log: str, extra_args: list[str] = ()) -> ServerProcess:
    """Ready when it returns; a context manager that stops it and checks it is gone."""
    # One intra-op thread, as the tests' own torch (conftest): same kernels, same bits, no oversubscription.
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return ServerProcess(model, ["--device", "cpu", "--log-level", "warning", "--api-key", USER_KEY,
                                 "--admin-api-key", ADMIN_KEY, "--served-model-name", SERVED_NAME,
                                 "--kv-cache-tokens", "8192", "--max-body-bytes", str(MAX_BODY_BYTES),
                                 "--max-capture-bytes", str(MAX_CAPTURE_BYTES), *extra_args], log=log, env=env,
                         startup_timeout=180)


def metrics(http: httpx.Client) -> dict[str, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until the engine holds no request and no KV block (or fail at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["steerable:num_requests_live"] == 0 and m["steerable:kv_blocks_in_use"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def assert_nothing_held(http: httpx.Client) -> None:
    m = wait_idle(http)
    for name in ("num_requests_running", "num_requests_waiting", "steering_rows_in_use", "steering_configs_in_use",
                 "capture_requests_in_use", "kv_cache_usage_perc"):
        assert m[f"steerable:{name}"] == 0, name
    status = http.get("/v1/steering", headers=USER).json()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0, status


@contextlib.contextmanager
def app_in_thread(llm: Any) -> Iterator[httpx.Client]:
    """``llm`` (an ``AsyncLLM`` of this process) behind the OpenAI app, served by uvicorn on a thread
    on a free loopback port; yields a client of it. On exit the server stops, then the engine."""
    import uvicorn

    from steerable.entrypoints.openai import ServerSettings, build_app
    from steerable.entrypoints.openai.launcher import free_port

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(build_app(llm, ServerSettings(served_model_name="m")), port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield client
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()
    assert not thread.is_alive()
