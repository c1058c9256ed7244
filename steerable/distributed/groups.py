"""The process groups of one rank and the few collectives the model needs.

- the world group (NCCL on CUDA, gloo on CPU) carries the data: tensor-parallel all-reduces and
  gathers inside a stage's group, and the residual stream handed from stage to stage;
- two gloo groups over every rank carry the control: the driver's step broadcast (workers wait on
  it while the engine is idle, hence no timeout to speak of) and the stages' reports back to it.

Model layers learn their tensor-parallel group while they are built (``building``), so a model
file builds its layers the same way for one rank or many.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from steerable.distributed.placement import Placement

DATA_TIMEOUT = datetime.timedelta(minutes=10)  # a collective inside a step (ranks are in lockstep)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next step


class TPGroup:
    """The tensor-parallel group of a stage; with one rank every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None,
                 ranks: tuple[int, ...] = (0,)):
        self.rank = rank
        self.size = size
        self.group = group
        self.ranks = ranks  # global ranks, by tensor-parallel rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along ``dim`` in rank order, for rank 0 (None elsewhere).
        An all-gather, not a gather: a ring collective like the all-reduces (NCCL sets up no
        point-to-point connections for it, which a CUDA graph capture could not do)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.group)
        return x

    def warm_up(self, device: torch.device) -> None:
        """Run each collective once: NCCL creates its communicator and connections on first use,
        which must not happen while a CUDA graph is being captured."""
        x = torch.zeros(1, device=device)
        self.broadcast(self.all_reduce(x))
        self.gather(x)


class PipeLink:
    """The residual stream between consecutive stages, between ranks of the same tensor-parallel
    rank. Sends never block the host, so two stages never wait on each other's sends: on gloo a
    send completes before the next one starts (its tensor stays referenced until then); with NCCL
    the device stream orders them."""

    def __init__(self, prev: int | None, next: int | None):
        self.prev = prev
        self.next = next
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def receive(self, into: torch.Tensor) -> None:
        dist.recv(into, src=self.prev)

    def send(self, tensor: torch.Tensor) -> None:
        self.flush()
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.next)
        if tensor.is_cuda:  # the device stream waits for the send (the host does not): the next
            work.wait()  # forward may overwrite the tensor, a CUDA graph's output
        else:
            self._pending = (work, tensor)

    def flush(self) -> None:
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()


@dataclass
class ParallelContext:
    """One rank's place and groups: what the model runner and the layers it builds need."""

    placement: Placement
    tp: TPGroup
    pipe: PipeLink | None = None
    control: dist.ProcessGroup | None = None  # gloo, every rank: the driver's steps
    reports: dist.ProcessGroup | None = None  # gloo, every rank: stage reports to the driver

    @classmethod
    def single(cls, num_layers: int) -> ParallelContext:
        return cls(Placement.single(num_layers), TPGroup())

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over every rank (each rank sizes its KV cache; all must agree)."""
        if self.control is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


def init_groups(placement: Placement, device: torch.device, store: dist.Store | None) -> ParallelContext:
    """Join the world (``store`` from the spawning driver, or the environment under torchrun) and
    build every group. Each ``new_group`` is called by every rank, in the same order."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=placement.rank if store is not None else -1,
                            world_size=placement.world_size if store is not None else -1, timeout=DATA_TIMEOUT,
                            init_method=None if store is not None else "env://")
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    reports = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tp = TPGroup()
    for stage in range(placement.pp_size):
        ranks = tuple(placement.stage_rank(stage, r) for r in range(placement.tp_size))
        group = dist.new_group(list(ranks), backend=backend) if placement.tp_size > 1 else None
        if stage == placement.stage:
            tp = TPGroup(placement.tp_rank, placement.tp_size, group, ranks)
    pipe = None
    if placement.pp_size > 1:
        stage, r = placement.stage, placement.tp_rank
        pipe = PipeLink(placement.stage_rank(stage - 1, r) if not placement.is_first_stage else None,
                        placement.stage_rank(stage + 1, r) if not placement.is_last_stage else None)
    return ParallelContext(placement, tp, pipe, control, reports)


def close_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- layers under construction

_BUILDING: list[ParallelContext] = []


@contextlib.contextmanager
def building(context: ParallelContext) -> Iterator[None]:
    """Layers constructed inside take their shard and group from ``context``."""
    _BUILDING.append(context)
    try:
        yield
    finally:
        _BUILDING.pop()


def current_tp() -> TPGroup:
    """The tensor-parallel group of the model being built (a single rank outside ``building``)."""
    return _BUILDING[-1].tp if _BUILDING else TPGroup()


def current_placement(num_layers: int) -> Placement:
    return _BUILDING[-1].placement if _BUILDING else Placement.single(num_layers)
