"""Corpus-capture runs killed mid-way: ``steerable capture`` in a child process, SIGKILLed as soon as
its index lists a committed shard (the child's own replicas, if any, end with it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_after_first_shard(args: list[str], index_path: Path, timeout: float = 300) -> dict:
    """Run the CLI with ``args`` and kill it once ``index_path`` lists a shard; the index as left."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "steerable.entrypoints.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if index_path.exists() and json.loads(index_path.read_text())["shards"]:
                break
            time.sleep(0.01)  # the index is replaced whole: each read sees one version
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return json.loads(index_path.read_text())
