"""The test suite's ``steerable serve``: the tiny model in a subprocess on a free loopback port
(``ServerProcess``), with both keys and small body and capture limits."""

from __future__ import annotations

import os

from steerable.entrypoints.openai.launcher import ServerProcess

USER_KEY, ADMIN_KEY = "user-key", "admin-key"
SERVED_NAME = "tiny"
MAX_BODY_BYTES = 2**20
MAX_CAPTURE_BYTES = 2**18
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve_test_model(model: str, log: str) -> ServerProcess:
    """Ready when it returns; a context manager that stops it and checks it is gone."""
    # One intra-op thread, as the tests' own torch (conftest): same kernels, same bits, no oversubscription.
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return ServerProcess(model, ["--device", "cpu", "--log-level", "warning", "--api-key", USER_KEY,
                                 "--admin-api-key", ADMIN_KEY, "--served-model-name", SERVED_NAME,
                                 "--kv-cache-tokens", "8192", "--max-body-bytes", str(MAX_BODY_BYTES),
                                 "--max-capture-bytes", str(MAX_CAPTURE_BYTES)], log=log, env=env,
                         startup_timeout=180)
