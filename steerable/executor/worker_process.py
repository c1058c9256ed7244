"""A rank other than the driver: build this rank's model runner, then run every step the driver
broadcasts, in order, until it says stop. Tensor-parallel rank 0 of each later pipeline stage
reports what the driver needs back (its sampled tokens, its captured rows).

Spawned ranks start in ``run_spawned``; under torchrun, ranks other than 0 call ``serve`` from
the engine constructor.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from steerable import cpu_memory, cpu_threads
from steerable.config import EngineConfig, ModelConfig
from steerable.distributed.groups import DATA_TIMEOUT, close_groups, init_groups
from steerable.distributed.placement import Placement
from steerable.executor.channel import ControlChannel, Kind, ReportChannel
from steerable.executor.codec import decode, encode
from steerable.models.loader import ModelSource
from steerable.worker.model_runner import ModelRunner

JOINED_KEY = "steerable/joined/{rank}"


@dataclass(frozen=True)
class WorkerArgs:
    """What a rank is started with: the driver's settings and decisions, never a request. The
    model config travels without its HF config object, so a rank need not import transformers."""

    config: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    dtype: torch.dtype
    max_model_len: int
    partition: list[tuple[int, int]]  # each pipeline stage's layers
    rank: int
    store_port: int | None = None  # the driver's TCPStore on this host (None: torchrun's rendezvous)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Rank ``local_rank`` of this host takes the GPU that many places after the driver's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def run_spawned(args: WorkerArgs, errors: Connection) -> None:
    """Process entry of a spawned rank. A failure is sent to the driver as text, then the process
    exits (closing its connections, so the driver's next collective fails at once)."""
    config = args.config
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    try:
        if config.resolve_device().type == "cpu":  # the ranks share the host's cores
            cpu_memory.keep_freed_memory()
            cpu_threads.apply(config.cpu_threads and max(1, config.cpu_threads // world), world)
        else:  # a rank only feeds its GPU: a pool of CPU threads would contend with the others' (as vLLM)
            torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", args.store_port, world, is_master=False, timeout=DATA_TIMEOUT)
        store.set(JOINED_KEY.format(rank=args.rank), "1")
        serve(args, args.rank, store)
    except BaseException:
        with contextlib.suppress(OSError):  # the driver may be gone already
            errors.send_bytes(traceback.format_exc().encode())
        raise SystemExit(1) from None


def serve(args: WorkerArgs, local_rank: int, store: dist.Store | None) -> None:
    """Join the groups (``store``: the driver's; None: rendezvous from the environment), load this
    rank's shard and stage, and run the driver's steps until it shuts down."""
    config = args.config
    device = rank_device(config.resolve_device(), local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    placement = Placement.of(args.rank, config.tensor_parallel_size, args.partition)
    context = init_groups(placement, device, store)
    try:
        runner = ModelRunner(config, args.model_config, args.source, device, args.dtype, args.max_model_len, context)
        control, reports = ControlChannel(context.control), ReportChannel(context.reports)
        # One step stays in flight while the next message is received and the next step launched,
        # as the driver's own loop keeps one: the device never idles on this rank's host work, and
        # a pipeline's last stage takes the next batch's activations while it still computes the
        # previous batch. A step's report therefore leaves with the next message: the next step, or
        # a FLUSH when the driver waits for that report before it can schedule more.
        in_flight = None
        while True:
            kind, payload = control.receive()
            if kind is Kind.SHUTDOWN:
                break
            launched = None
            if kind is Kind.STEP:
                step = decode(payload)
                launched = (runner.launch(step), placement.reports(step))
            if in_flight is not None:
                output = runner.finish(in_flight[0])
                if in_flight[1]:
                    reports.send(encode(output))
            in_flight = launched
        if in_flight is not None:
            runner.finish(in_flight[0])
        reports.flush()
        runner.shutdown()
    finally:
        close_groups()
