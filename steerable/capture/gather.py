"""The capture data plane on the worker: gather the planned rows at the hook points into staging
tensors, then bring them to the host in one pinned copy per dtype.

Row indices live in persistent device buffers, so a CUDA graph replays the gathers of a step with
the same plan shape (hook, layers, dtype per group) but other rows; a graph gathers a fixed number
of rows (the padded step size) and the padding rows are dropped when copying out.

Under tensor parallelism every rank holds the same plan. Replicated activations (the residual
stream, router logits) are recorded by tensor-parallel rank 0 alone; a component split over the
ranks (per-head attention outputs) is gathered from all of them into rank 0's row, in the layout
one rank would have. Every rank makes the same calls, so the gathers never wait on a rank that
chose differently.
"""

from __future__ import annotations

import torch

from steerable.checks import FLOAT_DTYPES
from steerable.distributed.groups import TPGroup
from steerable.step import CapturePlan, Site


class CaptureBuffers:
    """Persistent row-index buffers, one per group of a step, each ``max_tokens`` long.
    ``sharded``: components whose value on a rank is its slice of the row (gathered over ``tp``)."""

    def __init__(self, max_tokens: int, device: torch.device, tp: TPGroup | None = None,
                 sharded: frozenset[str] = frozenset()):
        self.max_tokens = max_tokens
        self.device = device
        self.tp = tp if tp is not None else TPGroup()
        self.sharded = sharded if self.tp.size > 1 else frozenset()
        self.index: list[torch.Tensor] = []

    def step_view(self, plan: CapturePlan, padded_tokens: int, graphed: bool) -> "StepCapture":
        while len(self.index) < len(plan.groups):
            self.index.append(torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device))
        views = []
        for group, buffer in zip(plan.groups, self.index):
            n = len(group.rows)
            buffer[:n].copy_(torch.from_numpy(group.rows), non_blocking=True)
            if graphed:  # the graph gathers padded_tokens rows; the extra ones read row 0 and are dropped
                buffer[n:padded_tokens].zero_()
            views.append(buffer[:padded_tokens] if graphed else buffer[:n])
        return StepCapture(plan, views, self.tp, self.sharded)


class StepCapture:
    """What the hook points ask of capture in one step: is a site read, and record it."""

    def __init__(self, plan: CapturePlan, index: list[torch.Tensor], tp: TPGroup, sharded: frozenset[str]):
        self.plan = plan
        self.index = index
        self.tp = tp
        self.sharded = sharded
        self.dtypes = [FLOAT_DTYPES[g.dtype] if g.dtype is not None else None for g in plan.groups]
        self.sites: dict[Site, list[int]] = {}
        for g, group in enumerate(plan.groups):
            for layer in group.layers:
                self.sites.setdefault((group.hook, layer), []).append(g)
        self.staged: dict[tuple[int, int], torch.Tensor] = {}  # (group, layer) -> gathered rows

    def wants(self, site: Site) -> bool:
        return site in self.sites

    def record(self, site: Site, value: torch.Tensor) -> None:
        """Gather the planned rows into a fresh tensor (safe to copy out after the next step starts)."""
        sharded = site[0] in self.sharded
        if not sharded and self.tp.rank != 0:
            return
        for g in self.sites.get(site, ()):
            rows = value.index_select(0, self.index[g])
            if sharded:
                rows = self.tp.gather(rows, dim=-1)
                if rows is None:  # kept by rank 0
                    continue
            dtype = self.dtypes[g]
            self.staged[(g, site[1])] = rows.to(dtype) if dtype is not None else rows


def copy_to_host(staged: dict[tuple[int, int], torch.Tensor],
                 plan: CapturePlan) -> tuple[dict[tuple[int, int], torch.Tensor], torch.cuda.Event | None]:
    """Enqueue the device-to-host copies of a step's gathered rows (padding dropped): one pinned
    buffer per dtype. Returns the host views and the event to wait on before reading them."""
    keys = list(staged)
    tensors = [staged[k][:len(plan.groups[k[0]].rows)] for k in keys]
    if not tensors or tensors[0].device.type == "cpu":
        return dict(zip(keys, tensors)), None
    host: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, indices in by_dtype.items():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        pinned = torch.empty(flat.shape, dtype=dtype, pin_memory=True)
        pinned.copy_(flat, non_blocking=True)
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            host[i] = pinned[offset:offset + n].view(tensors[i].shape)
            offset += n
    done = torch.cuda.Event()
    done.record()
    return dict(zip(keys, host)), done
