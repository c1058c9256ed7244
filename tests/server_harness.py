"""``steerable serve`` in a subprocess on a free loopback port, for the server tests: started once,
ready when ``/health`` answers (within a deadline), stopped with SIGTERM and checked to be gone."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

USER_KEY, ADMIN_KEY = "user-key", "admin-key"
SERVED_NAME = "tiny"
MAX_BODY_BYTES = 2**20
MAX_CAPTURE_BYTES = 2**18
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log: str):
        self.url = url
        self.proc = proc
        self.log = log

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log) as f:
            return f.read()[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str, log: str, *args: str, startup_s: float = 180.0) -> Iterator[Server]:
    """The server, ready; on exit it is stopped and must be gone (no process survives)."""
    port = free_port()
    cmd = [sys.executable, "-m", "steerable.entrypoints.cli", "serve", model, "--port", str(port), "--device", "cpu",
           "--log-level", "warning", *args]
    # One intra-op thread, as the tests' own torch (conftest): same kernels, same bits, no oversubscription.
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_ready(server, startup_s)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            raise AssertionError(f"the server ignored SIGTERM:\n{server.log_tail()}") from None
    assert proc.returncode is not None


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"the server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server was not ready within {timeout} s:\n{server.log_tail()}")


def serve_test_model(model: str, log: str) -> contextlib.AbstractContextManager[Server]:
    """The test suite's server: both keys, small body and capture limits."""
    return serve(model, log, "--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY, "--served-model-name", SERVED_NAME,
                 "--kv-cache-tokens", "8192", "--max-body-bytes", str(MAX_BODY_BYTES), "--max-capture-bytes",
                 str(MAX_CAPTURE_BYTES))

