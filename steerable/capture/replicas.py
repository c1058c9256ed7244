"""``replicas=R`` (``--replicas R``): R engine processes on one machine, one per GPU (or per
``tensor_parallel_size`` GPUs); on CPU, each pinned to its own share of the cores. Each takes whole
shards from this process, the driver, and captures them with the same loop a single engine runs
(``corpus_run.capture_shards``); the driver alone commits (renames into place and lists), so the
output is the same dataset, shard for shard and row for row, as one engine's.

Protocol, one duplex pipe per replica: the replica asks ``want`` when idle (the driver answers
with a shard, ``exit`` once everything is committed, or later, when a shard comes free) and
``more`` while capturing (answered at once: a shard or ``none``, so its engine never waits on the
driver); it reports ``done`` with each finished shard's staged file and ``error`` with the
traceback of an exception, which stops the run. A replica that dies (killed, out of memory) is
noticed through its process sentinel: the shards it held go back to the queue, ahead of the rest,
and another replica redoes them; its unfinished files are removed at the end. Nothing is written
twice or lost, because a shard is listed only when the driver commits it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from steerable.capture.corpus_run import ShardSpec, capture_shards
from steerable.capture.shard_stores import Commit, ShardTask
from steerable.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class _Replica:
    rid: int
    proc: Any
    conn: Connection
    held: list[int] = field(default_factory=list)  # shards handed to it, not committed yet
    lifeline: Connection | None = None
    idle: bool = False  # waiting for a shard
    alive: bool = True


def placements(engine_config: dict[str, Any], replicas: int) -> list[dict[str, Any]]:
    """Per replica: the environment and cores it runs with (GPUs by CUDA_VISIBLE_DEVICES; on
    CPU a contiguous share of this process's cores and as many intra-op threads)."""
    import torch

    per = engine_config.get("tensor_parallel_size", 1) * engine_config.get("pipeline_parallel_size", 1)
    on_gpu = engine_config.get("device", "auto") != "cpu" and torch.cuda.is_available()
    if on_gpu:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        if replicas * per > len(gpus):
            raise InvalidRequestError(f"replicas: {replicas} replicas of {per} GPU(s) each need {replicas * per} GPUs; "
                                      f"{len(gpus)} are visible")
        return [{"env": {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])}, "cores": None}
                for i in range(replicas)]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // replicas)
    return [{"env": {}, "cores": cores[(i * share) % len(cores):][:share] or cores[:share]} for i in range(replicas)]


def capture_on_replicas(plan: Any, todo: list[int], engine_config: dict[str, Any], sae: tuple[str, Any] | None,
                        replicas: int, commit: Commit) -> dict[str, Any]:
    """Capture shards ``todo`` of ``plan`` on ``replicas`` processes; ``commit`` each finished one.
    Returns counts (replicas, deaths, shards redone) and the replicas' summed ``RunStats`` times."""
    ctx = mp.get_context("spawn")
    driver = _Driver(plan, todo, commit, replicas)
    try:
        for rid, place in enumerate(placements(engine_config, replicas)):
            config = dict(engine_config)
            if place["cores"] is not None and config.get("cpu_threads") is None:
                config["cpu_threads"] = len(place["cores"])
            ours, theirs = ctx.Pipe(duplex=True)
            life_end, life_hold = ctx.Pipe(duplex=False)  # the held end closes when this process dies, however
            proc = ctx.Process(target=_replica_main, args=(theirs, life_end, config, sae, plan.spec, place),
                               daemon=True, name=f"steerable-replica-{rid}")
            proc.start()
            theirs.close()
            life_end.close()
            driver.workers.append(_Replica(rid, proc, ours, lifeline=life_hold))
        driver.run()
    finally:
        for w in driver.workers:
            w.proc.join(timeout=30)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
            w.lifeline.close()
        plan.run_dir.remove_parts()  # what dead replicas left half-written
    return driver.stats


class _Driver:
    """Hands shards out, commits what comes back, buries the dead; runs until every replica has
    exited (told to once every shard is committed, after reporting its times)."""

    def __init__(self, plan: Any, todo: list[int], commit: Commit, replicas: int):
        self.plan, self.commit = plan, commit
        self.pending = deque(todo)
        self.remaining = len(todo)
        self.workers: list[_Replica] = []
        self.stats: dict[str, Any] = {"replicas": replicas, "replicas_died": 0, "shards_redone": 0}

    def run(self) -> None:
        while True:
            live = [w for w in self.workers if w.alive]
            if not live:
                if self.remaining:
                    codes = [w.proc.exitcode for w in self.workers]
                    raise RuntimeError(f"capture_corpus: every replica died (exit codes {codes}); the shards "
                                       "committed so far are kept: run again with --resume")
                return
            ready = wait([w.conn for w in live] + [w.proc.sentinel for w in live])
            for w in live:
                if w.conn in ready or w.proc.sentinel in ready:
                    self._serve(w)
            for w in self.workers:
                if w.alive and w.idle and (self.pending or not self.remaining):
                    w.idle = False
                    self._answer_want(w)

    def _hand(self, w: _Replica) -> None:
        k = self.pending.popleft()
        logger.debug("replica %d (pid %d) takes shard %d", w.rid, w.proc.pid, k)
        w.held.append(k)
        w.conn.send(("task", self.plan.task(k)))

    def _answer_want(self, w: _Replica) -> None:
        if self.pending:
            self._hand(w)
        elif not self.remaining:
            w.conn.send(("exit",))
        else:  # answered when a dead replica's shard comes free, or with exit
            w.idle = True

    def _serve(self, w: _Replica) -> None:
        """Answer what replica ``w`` said, or bury it."""
        try:
            while w.conn.poll():
                message = w.conn.recv()
                kind = message[0]
                if kind == "done":
                    entry, part = message[1], message[2]
                    self.commit(entry, part)
                    w.held.remove(entry["shard"])
                    self.remaining -= 1
                elif kind == "more":
                    if self.pending:
                        self._hand(w)
                    else:
                        w.conn.send(("none",))
                elif kind == "want":
                    self._answer_want(w)
                elif kind == "stats":  # where a replica's time went, after each of its runs
                    for key, value in message[1].items():
                        self.stats[key] = self.stats.get(key, 0.0) + value
                elif kind == "error":
                    raise RuntimeError(f"capture_corpus: replica {w.rid} failed:\n{message[1]}")
        except (EOFError, OSError):  # its end of the pipe is closed: it has exited or died
            w.proc.join(timeout=10)
        if w.proc.is_alive():
            return
        w.alive = False
        if w.proc.exitcode == 0 and not w.held:
            return
        if w.held:
            logger.warning("capture_corpus: replica %d died (exit code %s) holding shard(s) %s; another replica "
                           "redoes them", w.rid, w.proc.exitcode, w.held)
            self.stats["shards_redone"] += len(w.held)
            self.pending.extendleft(sorted(w.held, reverse=True))
            w.held.clear()
        self.stats["replicas_died"] += 1


def _replica_main(conn: Connection, lifeline: Connection, engine_config: dict[str, Any], sae: tuple[str, Any] | None,
                  spec: ShardSpec, place: dict[str, Any]) -> None:
    """One replica: its own engine, capturing the shards the driver hands it until told to exit."""
    threading.Thread(target=_exit_with_driver, args=(lifeline,), daemon=True, name="driver-lifeline").start()
    os.environ.update(place["env"])
    if place["cores"] is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, place["cores"])
    sending = threading.Lock()  # the store commits from its writer thread

    def send(*message: Any) -> None:
        with sending:
            conn.send(message)

    waited = [0.0]  # seconds the engine's thread waited for the driver's answer to "more"

    def ask(kind: str) -> ShardTask | None:
        started = time.perf_counter()
        send(kind)
        reply = conn.recv()
        if kind == "more":
            waited[0] += time.perf_counter() - started
        if reply[0] == "exit":
            raise _Exit
        return reply[1] if reply[0] == "task" else None

    llm = None
    try:
        from steerable.entrypoints.llm import LLM

        llm = LLM(**engine_config)
        if sae is not None:
            llm.register_sae(*sae)
        while True:
            first = ask("want")

            def tasks(first: ShardTask = first) -> Any:
                task: ShardTask | None = first
                while task is not None:
                    yield task
                    task = ask("more")

            run = capture_shards(llm.llm_engine, spec, tasks(), lambda entry, part: send("done", entry, part))
            send("stats", {"step_seconds": run.step_seconds, "shard_seconds": run.shard_seconds,
                           "scheduling_seconds": waited[0], **run.store})
            waited[0] = 0.0
    except _Exit:
        pass
    except BaseException:
        send("error", traceback.format_exc())
        raise
    finally:
        if llm is not None:
            llm.shutdown()
        conn.close()


def _exit_with_driver(lifeline: Connection) -> None:
    """End this replica at once when the driver is gone (killed too): nothing it would write
    could be committed, and a resumed run must not find it still writing."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


class _Exit(Exception):
    """The driver has no more shards."""
