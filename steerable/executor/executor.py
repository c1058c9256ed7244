"""The driver's side of a multi-rank worker, with the ``launch``/``finish`` of a ``ModelRunner``.

The driver is rank 0: tensor-parallel rank 0 of the first pipeline stage, running its shard in
this process. ``launch`` broadcasts the step's encoding to every rank, then runs the local shard;
``finish`` collects the local result and the reports of later stages (the last stage's samples,
each stage's captured rows) and merges them into one ``StepOutput``. A rank reports a step when
the next message arrives (``worker.serve``), so finishing the last step published first sends a
FLUSH.

A rank that dies or raises ends the engine with an ``EngineDeadError`` naming it: its connections
close, so the driver's next collective or receive fails at once, and on CUDA the waits for the
device poll the ranks' liveness instead of blocking. ``shutdown`` (or garbage collection, or the
interpreter's exit) tells the ranks to stop and leaves no process behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref

import torch
import torch.distributed as dist

from steerable.config import EngineConfig, ModelConfig
from steerable.distributed.groups import close_groups, init_groups
from steerable.distributed.placement import Placement, layer_partition
from steerable.errors import EngineDeadError
from steerable.executor.channel import ControlChannel, Kind, ReportChannel
from steerable.executor.codec import decode, encode
from steerable.executor.launch import STOP_TIMEOUT_S, WorkerProcesses, torchrun_rank
from steerable.executor.worker_process import WorkerArgs, rank_device, serve
from steerable.models.loader import ModelSource
from steerable.step import CapturePlan, StepInput, StepOutput, Worker
from steerable.worker.model_runner import Launched, ModelRunner

logger = logging.getLogger(__name__)

_LIVENESS_PERIOD_S = 0.01  # how often a wait for the device checks the other ranks


def create_worker(config: EngineConfig, model_config: ModelConfig, source: ModelSource, device: torch.device,
                  dtype: torch.dtype, max_model_len: int) -> Worker:
    """The engine's worker: the model runner itself on one rank, the parallel executor on more.
    Under torchrun a rank other than 0 serves the driver here and exits when it shuts down."""
    if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
        return ModelRunner(config, model_config, source, device, dtype, max_model_len)
    args = WorkerArgs(config, source, dataclasses.replace(model_config, hf_config=None), dtype, max_model_len,
                      layer_partition(model_config.num_layers, config.pipeline_parallel_size), 0)
    rank = torchrun_rank()
    if rank is not None and rank != 0:
        serve(dataclasses.replace(args, rank=rank), int(os.environ["LOCAL_RANK"]), None)
        raise SystemExit(0)
    return ParallelExecutor(args, model_config, device)


@dataclasses.dataclass
class ParallelLaunched:
    local: Launched
    reporters: list[int]  # ranks whose report of this step the driver receives
    plan: CapturePlan | None  # the step's capture plan: which stage filled which layer of a block


@torch.inference_mode()
def _merge_stage_rows(captured: list, reported: list, plan: CapturePlan | None, stage: Placement) -> None:
    """Fill each group's block with the layers ``stage`` ran: a stage records only its own layers
    of a block (the rest of its block is unset), so every layer comes from the stage that owns it."""
    if plan is None:
        return
    for g, (group, block) in enumerate(zip(plan.groups, reported)):
        if block is None:
            continue
        if captured[g] is None:
            captured[g] = block
            continue
        for i, layer in enumerate(group.layers):
            if stage.owns((group.hook, layer)):
                captured[g][i].copy_(block[i])


class ParallelExecutor:
    def __init__(self, args: WorkerArgs, model_config: ModelConfig, device: torch.device):
        """``args``: what every rank is started with; ``model_config``: the driver's, HF config included."""
        config = args.config
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        world = tp * pp
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process; one parallel engine "
                               "runs per process (shut the other one down first)")
        self.placement = Placement.of(0, tp, args.partition)
        self.stages = [Placement.of(s * tp, tp, args.partition) for s in range(pp)]
        self._dead: str | None = None
        self._started = False
        procs, store = None, None
        if torchrun_rank() is None:
            if device.type == "cuda" and torch.cuda.device_count() - (device.index or 0) < world:
                raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {world} needs {world} GPUs on "
                                 f"this host from {device}; use torchrun to span hosts")
            procs = WorkerProcesses(args)
            store = procs.store
        elif int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes for tensor_parallel_size x "
                             f"pipeline_parallel_size = {world}")
        self.procs = procs
        self._ranks = _Ranks(procs)
        self._finalizer = weakref.finalize(self, self._ranks.stop)
        try:
            if procs is not None:
                procs.wait_joined()
            local_device = rank_device(device, 0)
            context = init_groups(self.placement, local_device, store)
            self._ranks.joined = True
            self.channel = self._ranks.channel = ControlChannel(context.control)
            self.reports = ReportChannel(context.reports)
            self.runner = ModelRunner(config, model_config, args.source, local_device, args.dtype, args.max_model_len,
                                      context)
        except BaseException as err:
            raise self._fail(err) from err
        self._latest: ParallelLaunched | None = None  # the last step published, its reports still held
        self.num_blocks = self.runner.num_blocks
        self.max_blocks_per_seq = self.runner.max_blocks_per_seq
        # Other stages' rows are merged into the driver's blocks as they are collected, and several
        # micro-batches run at once: sinks take a step's rows when it is finished, on this thread.
        self.host_block_lifetime = None
        self._started = True

    # ------------------------------------------------------------ one step

    def launch(self, step: StepInput) -> ParallelLaunched:
        self._check()
        try:
            self.channel.publish(Kind.STEP, encode(step))
            local = self.runner.launch(step)
        except Exception as err:
            raise self._fail(err) from err
        launched = ParallelLaunched(local, [p.rank for p in self.stages if p.reports(step)], step.capture)
        self._latest = launched  # the ranks report it with the next message
        return launched

    def finish(self, launched: ParallelLaunched) -> StepOutput:
        try:
            if launched is self._latest:
                self._latest = None
                if launched.reporters:
                    self.channel.publish(Kind.FLUSH)
            self._await_device(launched.local)
            output = self.runner.finish(launched.local)
            captured = list(output.captured)
            for rank in launched.reporters:
                report: StepOutput = decode(self.reports.receive(rank))
                _merge_stage_rows(captured, report.captured, launched.plan, self.stages[rank // self.placement.tp_size])
                if report.sampled:
                    output = dataclasses.replace(output, sampled=report.sampled, logprobs=report.logprobs)
                if report.prompt_logprobs:
                    output = dataclasses.replace(output, prompt_logprobs=report.prompt_logprobs)
            output = dataclasses.replace(output, captured=captured)
        except Exception as err:
            raise self._fail(err) from err
        return output

    def _await_device(self, launched: Launched) -> None:
        """Wait for the step's copies to the host while checking that every rank is alive: a
        collective whose peer died never completes on a GPU."""
        if self.procs is None:
            return
        events = [e for e in (launched.samples.done if launched.samples else None, launched.copied) if e is not None]
        for event in events:
            checked = time.monotonic()
            while not event.query():
                if time.monotonic() - checked > _LIVENESS_PERIOD_S:
                    self._check()
                    checked = time.monotonic()
                time.sleep(0)

    # ------------------------------------------------------------ faults and lifecycle

    def _check(self) -> None:
        if self._dead is None and self.procs is not None and self.procs.failures():
            self._fail(RuntimeError("a worker process ended"))
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _fail(self, err: BaseException) -> BaseException:
        """Stop every rank and return the error to raise: the failed ranks' own reports when there
        are any (a rank that dies makes the driver's next transfer fail a moment later)."""
        if self._dead is not None:
            return EngineDeadError(self._dead)
        failures: list[str] = []
        if self.procs is not None:
            deadline = time.monotonic() + 2.0
            while not (failures := self.procs.failures()) and time.monotonic() < deadline:
                time.sleep(0.05)
            for rank, text in self.procs.reports.items():
                logger.error("worker rank %d failed:\n%s", rank, text)
        self._ranks.healthy = False
        self._finalizer()
        if not failures and not self._started and not isinstance(err, RuntimeError):
            self._dead = f"the engine failed to start ({type(err).__name__}: {err})"
            return err  # the driver's own error while loading (a model that does not split, say): as it is
        what = "; ".join(failures) if failures else f"{type(err).__name__}: {err}"
        if failures and not self.procs.reports and not self._ranks.joined:  # died before running any code of ours
            what += (" - a script that starts a parallel LLM must guard its entry point with "
                     "`if __name__ == '__main__':`, as multiprocessing requires")
        self._dead = f"the parallel engine stopped ({what}); create a new LLM"
        return EngineDeadError(self._dead)

    def stats(self) -> dict[str, int]:
        return self.runner.stats()

    def shutdown(self) -> None:
        """Stop the other ranks and free this rank's model and cache (idempotent)."""
        if self._dead is None:
            self._dead = "the engine is shut down"
            self.runner.shutdown()
        self._finalizer()


class _Ranks:
    """What ending the executor must undo: the other ranks and this process's process groups.
    Kept apart from the executor so a finalizer can run it when the executor is collected."""

    def __init__(self, procs: WorkerProcesses | None):
        self.procs = procs
        self.channel: ControlChannel | None = None
        self.joined = False
        self.healthy = True

    def stop(self) -> None:
        if self.healthy and self.channel is not None:
            try:
                self.channel.publish(Kind.SHUTDOWN)
                self.channel.flush()
            except Exception as err:  # a rank died since the last step; the kill below still runs
                logger.warning("could not tell the ranks to stop: %s", err)
        if self.procs is not None:
            self.procs.stop(timeout=STOP_TIMEOUT_S if self.healthy else 0.0)
        if self.joined:
            close_groups()
