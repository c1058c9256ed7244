"""The capture data plane on the worker: gather the planned rows at the hook points into one
staging block per group, then bring the blocks to the host.

A group's block is ``[layers, rows, width]``: every layer's rows of one step side by side, so the
driver hands a whole step to a stream with one copy per layer and a request's rows of every layer
with one ``index_select``. Row indices live in persistent device buffers, so a CUDA graph replays
the gathers of a step with the same plan shape (hook, layers, dtype per group) but other rows; a
graph gathers a fixed number of rows (the padded step size: a decode step's padded batch, a mixed
step's padded tokens) and only the planned ones are copied out. Graphed steps write their blocks
into one staging slab per group position, shared by every graph: graphs replay one at a time and
each step's blocks are copied out right behind its forward on the same stream, so a graph needs no
memory of its own for them (a mixed step's padded block of every layer would otherwise be pinned by
each of the mixed ladder's graphs).

Under tensor parallelism every rank holds the same plan. Replicated activations (the residual
stream, router logits) are recorded by tensor-parallel rank 0 alone; a component split over the
ranks (per-head attention outputs) is gathered from all of them into rank 0's block, in the layout
one rank would have; attention patterns likewise, each rank computing its own heads. A group with
an SAE (or a transcoder) encodes its gathered rows there and then (``SaeTables``) and stages each
row's top features instead of the row, per layer. A transcoder error group reads at two points
of each layer: where the transcoder reads, whose rows add their reconstruction to the group's
float32 block (at every output layer they decode to), and ``mlp_out``, where the block's layer
becomes the MLP's output minus that reconstruction. Under pipeline parallelism a stage fills only
its own layers of a block (a group with none there has no block); the driver merges the stages'
blocks.

On CUDA the copy to the host must neither stall the next step nor race it: the blocks are copied
(device to device, a few microseconds) into an outbox, and a side stream moves the outbox to pinned
host memory while the compute stream runs on. Outboxes and host buffers come in ``OUTBOX_SETS``
sets used by copying steps in turn, so a step's host rows stay valid until the third copying step
after it is launched (``host_block_lifetime`` = 2 launches): the driver finishes step N before it
launches step N + 2, and a threaded sink may read step N's rows until it launches step N + 3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from steerable.capture.pattern_pass import PatternRows, layer_patterns
from steerable.capture.patterns import padded_width
from steerable.checks import FLOAT_DTYPES
from steerable.distributed.groups import TPGroup
from steerable.hook_points import ATTENTION_PATTERNS, MLP_OUT, TRANSCODER_ERROR
from steerable.sae.worker_tables import SaeTables
from steerable.step import CapturePlan, Site, StepInput, to_device

OUTBOX_SETS = 3


class CaptureBuffers:
    """Persistent row-index buffers, one per group of a step, each ``max_tokens`` long, and the
    double-buffered outbox of the copies to the host. ``sharded``: components whose value on a
    rank is its slice of the row (gathered over ``tp``)."""

    def __init__(self, max_tokens: int, device: torch.device, tp: TPGroup | None = None,
                 sharded: frozenset[str] = frozenset(), windows: Sequence[int | None] = (),
                 saes: SaeTables | None = None):
        """``windows``: every model layer's sliding window (None: full), for attention patterns."""
        self.max_tokens = max_tokens
        self.windows = list(windows)
        self.saes = saes
        self.device = device
        self.tp = tp if tp is not None else TPGroup()
        self.sharded = sharded if self.tp.size > 1 else frozenset()
        self.index: list[torch.Tensor] = []
        self._outboxes = [_Outbox(device) for _ in range(OUTBOX_SETS)] if device.type == "cuda" else []
        # Later copying launches a step's host rows outlive (on a CPU they are the step's own blocks).
        self.host_block_lifetime = OUTBOX_SETS - 1
        self._turn = 0
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slabs: list[torch.Tensor] = []  # per group position: graphed steps' blocks (CUDA only)

    def step_view(self, plan: CapturePlan, padded_tokens: int, graphed: bool,
                  step: StepInput | None = None) -> "StepCapture":
        """``step``: the step's input, which places attention-pattern rows (never graphed)."""
        parts = [group.rows for group in plan.groups]
        widths = {}
        for g, group in enumerate(plan.groups):
            if group.hook == ATTENTION_PATTERNS:
                seqs, positions = PatternRows.host_columns(group.rows, step.positions, step.query_start)
                parts += [seqs, positions]
                widths[g] = padded_width(positions, [self.windows[layer] for layer in group.layers])
        packed = to_device(np.concatenate(parts).astype(np.int64, copy=False), self.device)  # one copy
        offsets = np.cumsum([0] + [len(p) for p in parts])
        part = iter(range(len(plan.groups), len(parts)))  # each pattern group's seqs, then positions
        patterns = {}
        for g, width in widths.items():
            seqs, positions = next(part), next(part)
            patterns[g] = PatternRows(packed[offsets[g]:offsets[g + 1]], packed[offsets[seqs]:offsets[seqs + 1]],
                                      packed[offsets[positions]:offsets[positions + 1]], width)
        while len(self.index) < len(plan.groups):
            self.index.append(torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device))
        views = []
        for g, buffer in enumerate(self.index[:len(plan.groups)]):
            n = offsets[g + 1] - offsets[g]
            buffer[:n].copy_(packed[offsets[g]:offsets[g + 1]])
            if graphed:  # the graph gathers padded_tokens rows; the extra ones read row 0 and are dropped
                buffer[n:padded_tokens].zero_()
            views.append(buffer[:padded_tokens] if graphed else buffer[:n])
        # On a CPU a step's blocks are its host rows until the driver delivers them: its own.
        shared = graphed and self._copy_stream is not None
        return StepCapture(plan, views, self.tp, self.sharded, patterns, self.saes,
                           self._slab_block if shared else None)

    def _slab_block(self, g: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Group position ``g``'s block of a graphed step: a view of its slab, which grows (at least
        doubling) when a larger block is asked for. A graph captured on an older slab keeps it alive
        through its staged blocks, so at most a few slabs per position exist, twice the largest."""
        nbytes = math.prod(shape) * dtype.itemsize
        while len(self._slabs) <= g:
            self._slabs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._slabs[g].numel() < nbytes:
            self._slabs[g] = torch.empty(max(nbytes, 2 * self._slabs[g].numel()), dtype=torch.uint8,
                                         device=self.device)
        return self._slabs[g][:nbytes].view(dtype).view(shape)

    def copy_to_host(self, blocks: list[torch.Tensor | None], plan: CapturePlan
                     ) -> tuple[list[torch.Tensor | None], torch.cuda.Event | None]:
        """Enqueue the copies of a step's gathered blocks to the host. Returns per group the host
        rows ``[layers, rows, width]`` (padding dropped; None where this rank recorded nothing)
        and the event to wait on before reading them; the host rows stay valid until the third
        copying step after this one is launched."""
        counts = [len(group.rows) for group in plan.groups]
        if self._copy_stream is None:
            return [None if block is None else block[:, :n] for block, n in zip(blocks, counts)], None
        present = [(g, block) for g, block in enumerate(blocks) if block is not None]
        host: list[torch.Tensor | None] = [None] * len(blocks)
        if not present:
            return host, None
        outbox = self._outboxes[self._turn]
        self._turn = (self._turn + 1) % len(self._outboxes)
        copied = outbox.copy([block[:, :counts[g]] for g, block in present], self._copy_stream)
        for (g, _), rows in zip(present, copied):
            host[g] = rows
        return host, outbox.done


class _Outbox:
    """One set of device and pinned host buffers per dtype (grown on demand) for a step's copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.staging: dict[torch.dtype, torch.Tensor] = {}
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.done = torch.cuda.Event()

    def copy(self, blocks: list[torch.Tensor], stream: torch.cuda.Stream) -> list[torch.Tensor]:
        """Copy ``blocks`` (the planned rows of each: views that skip a graph's padding rows) out,
        packed per dtype; returns their host copies, valid once ``done`` has passed."""
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.done)  # the previous copy out of these buffers has finished
        offsets, totals = [], {}
        for block in blocks:
            offsets.append(totals.get(block.dtype, 0))
            totals[block.dtype] = offsets[-1] + block.numel()
        for dtype, total in totals.items():
            if dtype not in self.staging or self.staging[dtype].numel() < total:
                size = max(total, 2 * self.staging[dtype].numel() if dtype in self.staging else 0)
                self.staging[dtype] = torch.empty(size, dtype=dtype, device=self.device)
                self.host[dtype] = torch.empty(size, dtype=dtype, pin_memory=True)
        for block, offset in zip(blocks, offsets):
            self.staging[block.dtype][offset:offset + block.numel()].view(block.shape).copy_(block)
        ready = torch.cuda.Event()
        ready.record(compute)
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for dtype, total in totals.items():
                self.host[dtype][:total].copy_(self.staging[dtype][:total], non_blocking=True)
            self.done.record(stream)
        return [self.host[block.dtype][offset:offset + block.numel()].view(block.shape)
                for block, offset in zip(blocks, offsets)]


class StepCapture:
    """What the hook points ask of capture in one step: is a site read, and record it."""

    def __init__(self, plan: CapturePlan, index: list[torch.Tensor], tp: TPGroup, sharded: frozenset[str],
                 patterns: dict[int, PatternRows] | None = None, saes: SaeTables | None = None,
                 new_block: Callable[[int, tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        """``new_block(g, shape, dtype)``: where group ``g``'s block goes (default: a tensor of its
        own, as eager steps use; on a CPU the block is the host rows the driver reads later)."""
        self.plan = plan
        self.new_block = new_block or self._fresh_block
        self.saes = saes
        self.index = index
        self.patterns = patterns or {}  # group -> its attention-pattern rows
        self.tp = tp
        self.sharded = sharded
        self.dtypes = [FLOAT_DTYPES[g.dtype] if g.dtype is not None else None for g in plan.groups]
        self.sites: dict[Site, list[tuple[int, int]]] = {}  # site -> (group, position among its layers)
        for g, group in enumerate(plan.groups):
            if group.hook == TRANSCODER_ERROR:
                transcoder = saes.transcoders.get(group.sae)
                if transcoder is None:  # none of its layers on this pipeline stage
                    continue
                points = (transcoder.hook, MLP_OUT)  # where it reads, then where the MLP's output is
            else:
                points = (group.hook,)
            for i, layer in enumerate(group.layers):
                for point in points:
                    self.sites.setdefault((point, layer), []).append((g, i))
        self.blocks: list[torch.Tensor | None] = [None] * len(plan.groups)

    def wants(self, site: Site) -> bool:
        return site in self.sites

    def record(self, site: Site, value: torch.Tensor) -> None:
        """Gather the planned rows into the group's block (allocated at its first site, inside a
        CUDA-graph capture from the graph's pool, so the replay writes the same memory)."""
        sharded = site[0] in self.sharded
        if not sharded and self.tp.rank != 0:
            return
        for g, i in self.sites.get(site, ()):
            group = self.plan.groups[g]
            if group.hook == TRANSCODER_ERROR:
                self._record_error(g, i, site, value)
                continue
            if group.sae is not None:
                self._record_features(g, i, site[1], value)
                continue
            index, rows = self.index[g], value
            if sharded:  # every rank's slice of the rows, side by side on rank 0 (None elsewhere)
                rows = self.tp.gather(value.index_select(0, index), dim=-1)
                if rows is None:
                    continue
                index = None
            self._store(g, i, rows, index)

    def record_patterns(self, site: Site, q: torch.Tensor, attn: Any, meta: Any) -> None:
        """The planned rows' attention probabilities at ``attn`` (its K/V of this step written),
        ``[rows, heads * width]`` per layer; under tensor parallelism each rank computes its heads
        and rank 0 gathers them in head order."""
        for g, i in self.sites.get(site, ()):
            value = layer_patterns(q, attn, meta.block_table[attn.kv_group], self.patterns[g])
            if self.tp.size > 1:
                value = self.tp.gather(value, dim=1)
                if value is None:
                    continue
            heads = self.plan.groups[g].heads
            if heads is not None:
                value = value[:, list(heads)]
            self._store(g, i, value.flatten(1), None)

    def _store(self, g: int, i: int, rows: torch.Tensor, index: torch.Tensor | None) -> None:
        """Layer ``i`` of group ``g``'s block: ``rows`` (or its ``index`` rows)."""
        block = self.blocks[g]
        if block is None:
            shape = (len(self.plan.groups[g].layers), len(self.index[g]), rows.shape[-1])
            block = self.blocks[g] = self.new_block(g, shape, self.dtypes[g] or rows.dtype)
        if index is None:
            block[i].copy_(rows)
        elif block.dtype == rows.dtype:
            torch.index_select(rows, 0, index, out=block[i])
        else:
            block[i].copy_(rows.index_select(0, index))

    def _record_features(self, g: int, i: int, layer: int, value: torch.Tensor) -> None:
        """Layer ``i`` of an SAE (or transcoder) group's block ``[layers, rows, 2 * top_k]``: the
        planned rows' top features."""
        group = self.plan.groups[g]
        rows = value.index_select(0, self.index[g])
        block = self.blocks[g]
        if block is None:
            block = self.blocks[g] = self.new_block(g, (len(group.layers), len(self.index[g]), 2 * group.top_k),
                                                    torch.float32)
        self.saes.top_features(group.sae, layer, rows, group.top_k, block[i])

    def _record_error(self, g: int, i: int, site: Site, value: torch.Tensor) -> None:
        """A transcoder error group at ``site``: what the transcoder reads adds to the reconstruction
        its block accumulates; at ``mlp_out`` the layer's rows become the output minus it."""
        group = self.plan.groups[g]
        rows = value.index_select(0, self.index[g])
        block = self.blocks[g]
        if block is None:  # zeros: the reconstruction of every layer starts empty
            block = self.blocks[g] = self.new_block(g, (len(group.layers), len(self.index[g]), value.shape[-1]),
                                                    torch.float32).zero_()
        if site[0] == MLP_OUT:
            torch.sub(rows.float(), block[i], out=block[i])
        else:
            self.saes.transcoders[group.sae].reconstruct_from(site[1], rows, block, i)

    def staged(self) -> list[torch.Tensor | None]:
        """The step's blocks, one per group; None for a group this rank records nothing of (another
        tensor-parallel rank's, or another pipeline stage's layers)."""
        return list(self.blocks)

    def reset(self) -> None:
        self.blocks = [None] * len(self.plan.groups)

    def _fresh_block(self, g: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.index[g].device)
