"""CUDA graphs for decode and mixed steps, with steering, capture and (where it can) sampling inside.

A decode step of n requests is padded to the next size of a ladder and replayed from a graph of
the step's forward program captured the first time that shape is seen (the worker captures the
unsteered ladder at start-up). A step that mixes prefill chunks with decode rows (a new request
joining running ones) is padded to the next size of a second ladder of token counts and to one
sequence more than the engine runs: its attention grid depends only on those two, so one graph
serves any mix of query lengths. Its launches would otherwise take longer on the host than its
kernels on the device (about 20 ms against 10 for a 0.6B model at 256 running requests); steps
beyond the ladder's top run eagerly, where the kernels dominate. Everything that changes per step lives in persistent buffers the
graph reads: token ids and the owners of pending ones, positions, slot mapping, each sequence's
request slot (its block-table row is gathered in the graph), sequence lengths, the steering row
of every token, the capture row indices, sampling seeds and temperatures. What the graph cannot
read from a buffer is part of its key: the padded size, the steering signature (which op runs at
which site, and the table layout version: a table that grew has moved in memory), the shape of
the capture plan (which hook sites gather for which groups), and whether the step samples inside
(the LM head and the fused sampler), and for a mixed step that it is one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from steerable.worker.forward_context import ForwardContext

logger = logging.getLogger(__name__)

Program = Callable[[], tuple[torch.Tensor, "torch.Tensor | None"]]  # a step's forward: (hidden, samples or None)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # final hidden states [padded, H], owned by the graph
    tokens: torch.Tensor | None  # samples [padded] when the program samples
    staged: list[torch.Tensor] = field(default_factory=list)  # capture blocks per group, owned by the graph


def mixed_ladder(max_tokens: int, smallest: int = 64) -> list[int]:
    """Token counts of the mixed-step graphs: four per doubling (at most 25 % padding), multiples of
    16 from ``smallest`` up to ``max_tokens``."""
    sizes, base = set(), smallest
    while base <= max_tokens:
        sizes.update(base + base * i // 4 for i in range(4))
        base *= 2
    return sorted(s for s in sizes if s <= max_tokens)


class CudaGraphRunner:
    def __init__(self, max_num_seqs: int, max_mixed_tokens: int = 0):
        """``max_mixed_tokens``: the largest mixed step that replays a graph (0: none does)."""
        self.sizes = sorted({s for s in (1, 2, 4, 8, *range(16, max_num_seqs + 1, 16)) if s <= max_num_seqs}
                            | {max_num_seqs})
        self.mixed_sizes = mixed_ladder(max_mixed_tokens)
        self.mixed_seqs = max_num_seqs + 1
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.num_replays = 0
        self.num_captures = 0

    def padded_size(self, num_seqs: int) -> int | None:
        return _next(self.sizes, num_seqs)

    def mixed_padded_size(self, num_tokens: int) -> int | None:
        return _next(self.mixed_sizes, num_tokens)

    def run(self, ctx: ForwardContext, key: tuple, program: Program
            ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """Replay the graph for ``key``, or, if the key is new, run the step eagerly and capture
        ``program`` for the next ones: (hidden states, samples or None, capture gathers)."""
        entry = self.graphs.get(key)
        if entry is None:
            return self._capture(ctx, key, program)
        entry.graph.replay()
        self.num_replays += 1
        return entry.output, entry.tokens, entry.staged

    def _capture(self, ctx: ForwardContext, key: tuple, program: Program
                 ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """Run this step eagerly (which also compiles every kernel for the shape), then capture the
        graph without replaying it: the step has side effects a second run would see (the sampled
        tokens it stores per request slot are the next step's inputs, which the graph gathers)."""
        steering = key[1]
        if steering is not None:  # graphs baked against older steering tables are dead
            for stale in [k for k in self.graphs if k[1] is not None and k[1][-1] != steering[-1]]:
                del self.graphs[stale]
        output, tokens = program()
        staged = ctx.capture.staged() if ctx.capture is not None else []
        if ctx.capture is not None:
            ctx.capture.reset()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a graph is captured lazily, mid-run, while consumers on other threads
        # (dashboard accumulators, activation streams) keep working on their own streams; the
        # default global mode would fail their allocations and synchronisations.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            graph_output, graph_tokens = program()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = _Graph(graph, graph_output, graph_tokens,
                                  ctx.capture.staged() if ctx.capture is not None else [])
        self.num_captures += 1
        logger.debug("captured CUDA graph %s (%d total)", key[0], len(self.graphs))
        return output, tokens, staged


def _next(ladder: list[int], n: int) -> int | None:
    """The smallest size of ``ladder`` that holds ``n``, or None."""
    return next((size for size in ladder if size >= n), None)
