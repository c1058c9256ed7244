"""Starting and ending the other ranks.

On one host the driver starts one process per other rank (``torch.multiprocessing``, spawn) and
gives them a ``TCPStore`` it opened on a free port. Across hosts every rank is started by
``torchrun``, which provides the rendezvous in the environment (``torchrun_rank``). The ranks the
driver starts are daemons (they die with the interpreter) and report a failure as text on a pipe
before exiting.

``STEERABLE_WORKER_START_METHOD=forkserver`` starts them from multiprocessing's fork server
instead, which imports torch and steerable once: a rank then starts in about a second rather than
the several seconds a fresh interpreter takes to import torch (the test suite uses it). Ranks
read nothing else from the environment that the driver decides: the layer partition comes in
their arguments, since a fork server keeps the environment it started with.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from multiprocessing.connection import Connection

import torch.distributed as dist
import torch.multiprocessing as mp

from steerable.executor.worker_process import JOINED_KEY, WorkerArgs, run_spawned

JOIN_TIMEOUT_S = 300.0  # a rank's interpreter start and imports
STOP_TIMEOUT_S = 10.0  # after the shutdown message, before a rank is killed
START_METHOD_ENV = "STEERABLE_WORKER_START_METHOD"


def _start_context() -> mp.context.BaseContext:
    method = os.environ.get(START_METHOD_ENV, "spawn")
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{START_METHOD_ENV}={method!r}: expected 'spawn' or 'forkserver'")
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["steerable.executor.worker_process"])
    return context


def torchrun_rank() -> int | None:
    """This process's rank when an ``env://`` launcher (torchrun) started it, else None."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


class WorkerProcesses:
    """Ranks 1..world-1 on this host, spawned by the driver (rank 0)."""

    def __init__(self, args: WorkerArgs):
        """``args``: what every rank gets (its own ``rank`` is filled in here)."""
        world_size = args.config.tensor_parallel_size * args.config.pipeline_parallel_size
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        context = _start_context()
        self.processes: dict[int, mp.Process] = {}
        self.pipes: dict[int, Connection] = {}  # rank -> where its traceback arrives if it fails
        self.reports: dict[int, str] = {}  # rank -> the traceback it sent
        for rank in range(1, world_size):
            receiver, sender = context.Pipe(duplex=False)
            rank_args = replace(args, rank=rank, store_port=self.store.port)
            process = context.Process(target=run_spawned, args=(rank_args, sender), name=f"steerable-rank-{rank}",
                                      daemon=True)
            process.start()
            sender.close()
            self.processes[rank], self.pipes[rank] = process, receiver

    def wait_joined(self) -> None:
        """Until every rank is ready to join the process groups; raises if one dies first."""
        keys = [JOINED_KEY.format(rank=rank) for rank in self.processes]
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self.store.check(keys):
            if self.failures():
                raise RuntimeError("; ".join(self.failures()))
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker processes did not start within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def failures(self) -> list[str]:
        """A line per rank that has exited or reported an error (the last line of its traceback)."""
        for rank, pipe in self.pipes.items():
            if rank not in self.reports and not pipe.closed and pipe.poll():
                try:
                    self.reports[rank] = pipe.recv_bytes().decode(errors="replace").strip()
                except (EOFError, OSError):
                    pass
        lines = []
        for rank, process in self.processes.items():
            report = self.reports.get(rank)
            if report:
                lines.append(f"worker rank {rank} raised {report.splitlines()[-1]}")
            elif not process.is_alive():
                lines.append(f"worker rank {rank} exited with code {process.exitcode}")
        return lines

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Wait for the ranks to exit (they were told to), then terminate, then kill what is left."""
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
        for pipe in self.pipes.values():
            pipe.close()
