"""Running a benchmark the way a user does (``python -m benchmarks NAME --smoke``) and reading its
JSON records, shared by the benchmark test files (conftest's ``bench_cache_dir`` keeps the random
checkpoints for the session)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, cache_dir: str, *args: str, model: bool = True, env: dict | None = None) -> dict[str, list[dict]]:
    """``python -m benchmarks <script> --smoke``; stdout must be JSON lines only. Records by type."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "benchmarks", script, "--smoke", "--cache-dir", cache_dir, *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        assert record["bench"] == script
        records.setdefault(record["record"], []).append(record)
    header = records["header"][0]
    assert header["smoke"] is True and header["torch"] and header["command"].startswith(f"python -m benchmarks {script}")
    if model:
        assert header["model"] and records["llm_init"][0]["seconds"] > 0
    return records


def positive(record: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(record[key], (int, float)) and record[key] > 0, (key, record)
