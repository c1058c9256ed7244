"""``steerable serve`` in a subprocess, for code that wants a server of its own (benchmarks, tests,
a notebook): on a free loopback port, ready once ``/health`` answers within a deadline, stopped
with SIGTERM (SIGKILL if it lingers) and waited for, so no process outlives it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any


class ServerProcess:
    """``ServerProcess(model, ["--api-key", "k"])`` blocks until the server answers; ``url`` is its
    address. Use it as a context manager, or call ``stop``."""

    def __init__(self, model: str, args: Sequence[str] = (), log: str | None = None,
                 env: Mapping[str, str] | None = None, startup_timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or os.devnull
        cmd = [sys.executable, "-m", "steerable.entrypoints.cli", "serve", model, "--port", str(self.port), *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"the server was not ready within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM and wait; a server that ignores it is killed, and that is an error."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout)
            raise RuntimeError(f"the server ignored SIGTERM and was killed:\n{self.log_tail()}") from None

    def log_tail(self, chars: int = 4000) -> str:
        if self.log == os.devnull:
            return ""
        with open(self.log) as f:
            return f.read()[-chars:]

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
