"""The CUDA-graph runner's decisions on a CPU: ``EagerGraphs`` pads every step the way the runner
pads it for a replay (decode steps to the decode ladder, mixed steps to the mixed ladder and one
sequence more) and runs the step's program instead of replaying, so the padded shapes run through
the real kernels, and it records each step's graph key (None: the step would run eagerly)."""

from __future__ import annotations

from typing import Any

from steerable.worker.cuda_graphs import CudaGraphRunner


class EagerGraphs(CudaGraphRunner):
    def __init__(self, max_num_seqs: int, max_mixed_tokens: int):
        super().__init__(max_num_seqs, max_mixed_tokens)
        self.keys: list[tuple] = []

    def run(self, ctx: Any, key: tuple, program: Any) -> tuple:
        self.keys.append(key)
        hidden, tokens = program()
        return hidden, tokens, ctx.capture.staged() if ctx.capture is not None else []


def install(llm: Any, max_mixed_tokens: int) -> list[tuple[tuple | None, Any]]:
    """Give ``llm``'s worker an ``EagerGraphs`` and record, per step, the key of the graph it
    would replay (None: eager) and its ``StepInput``."""
    worker = llm.llm_engine.worker
    worker.graphs = EagerGraphs(worker.max_num_seqs, max_mixed_tokens)
    prepare, seen = worker._prepare, []

    def recorded(step):
        prepared = prepare(step)
        seen.append((prepared[2], step))
        return prepared

    worker._prepare = recorded
    return seen
