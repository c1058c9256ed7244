"""Parallel engines that fail and how they end (CPU, gloo): a killed worker fails every call fast
and stays dead saying why, a worker that raises fails the call with its error (at start too), an
interpreter that exits leaves no worker; and ``torchrun`` as the launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import PROMPTS
from parallel_harness import HANG_S, _env, _fork_server, _hang_guard, deadline, models, single  # noqa: F401 (fixtures)

from steerable import LLM, SamplingParams
from steerable.executor.launch import START_METHOD_ENV
from steerable.errors import EngineDeadError
from steerable.models import registry


# ---------------------------------------------------------------- faults


def _worker_pids() -> set[int]:
    """Processes this test process started to serve as ranks (spawned, or forked by the fork server)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(child.cmdline())
            if "spawn_main" in cmdline or (child.ppid() != os.getpid() and "forkserver" in cmdline):
                pids.add(child.pid)
    return pids


def test_killed_worker_fails_fast_and_shutdown_leaves_no_process(models):
    before = _worker_pids()
    with deadline(), _env(START_METHOD_ENV, "spawn"):
        llm = LLM(models["llama"], dtype="float32", device="cpu", kv_cache_tokens=4096, tensor_parallel_size=2,
                  pipeline_parallel_size=2)
    workers = _worker_pids() - before
    assert len(workers) == 3
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    victim = sorted(workers)[-1]
    killed = []

    def kill():
        time.sleep(1.0)
        killed.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert killed and time.monotonic() - killed[0] < 30
    with pytest.raises(EngineDeadError, match="exited with code -9"):  # and it stays dead, saying why
        llm.generate(PROMPTS[0], params, use_tqdm=False)
    llm.shutdown()
    assert not _worker_pids() - before


FAULT = """
import os
if os.environ.get("STEERABLE_TEST_FAULT_STEP"):  # a spawned rank 1 raises in the middle of a generate
    from steerable.worker import model_runner

    launch = model_runner.ModelRunner.launch

    def faulty(self, step):
        if step.step_id == int(os.environ["STEERABLE_TEST_FAULT_STEP"]) and self.parallel.placement.rank == 1:
            raise RuntimeError("injected fault")
        return launch(self, step)

    model_runner.ModelRunner.launch = faulty
"""


def test_raising_worker_fails_the_call_with_its_error(models, tmp_path, monkeypatch):
    """A rank that raises mid-run (a fault injected into the spawned rank only, through
    sitecustomize): the call in progress raises the rank's own error, promptly."""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("STEERABLE_TEST_FAULT_STEP", "5")
    with deadline(), _env(START_METHOD_ENV, "spawn"):
        llm = LLM(models["llama"], dtype="float32", device="cpu", kv_cache_tokens=4096, pipeline_parallel_size=2)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 raised RuntimeError: injected fault"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()


def test_worker_error_at_start_is_reported(models, monkeypatch):
    """A rank that raises while building its shard: the engine constructor raises its error."""
    monkeypatch.setitem(registry._MODELS, "ParallelOnlyHereForCausalLM", registry._MODELS["LlamaForCausalLM"])
    path = models["llama"] + "-renamed"
    if not os.path.exists(path):
        import shutil
        shutil.copytree(models["llama"], path)
        config = json.load(open(os.path.join(path, "config.json")))
        config["architectures"] = ["ParallelOnlyHereForCausalLM"]
        json.dump(config, open(os.path.join(path, "config.json"), "w"))
    before = _worker_pids()
    with pytest.raises(EngineDeadError, match="worker rank 1 raised ValueError: unknown architecture"):
        LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096, tensor_parallel_size=2)
    assert not _worker_pids() - before


EXIT_SCRIPT = """
import sys, psutil
from steerable import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_tokens=4096, tensor_parallel_size=2)
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
"""  # and exits without shutdown()


def test_interpreter_exit_leaves_no_worker(models, tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    done = subprocess.run([sys.executable, str(script), models["llama"]], env=env, capture_output=True, text=True,
                          timeout=HANG_S - 10)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids  # the worker (and multiprocessing's resource tracker)
    time.sleep(1.0)
    assert not [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- torchrun


TORCHRUN_SCRIPT = """
import json, sys
from steerable import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", device="cpu", kv_cache_tokens=4096, tensor_parallel_size=2)
    outs = llm.generate(sys.argv[3:], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    json.dump([o.outputs[0].token_ids for o in outs], open(sys.argv[2], "w"))
    llm.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_entry(models, single, tmp_path):
    """The multi-host entry, on one host: torchrun starts both ranks; rank 0 drives."""
    script, result = tmp_path / "run.py", tmp_path / "tokens.json"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != START_METHOD_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script), models["llama"],
           str(result), *PROMPTS[:2]]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S - 10)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = single["llama"].generate(PROMPTS[:2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                   use_tqdm=False)
    assert json.loads(result.read_text()) == [o.outputs[0].token_ids for o in ref]
