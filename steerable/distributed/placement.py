"""Where a rank sits: its tensor-parallel rank, its pipeline stage and that stage's layers, and
which hook-point sites it runs, and how many micro-batches a pipeline keeps in flight. Pure
arithmetic on the sizes (and ``STEERABLE_PP_LAYER_PARTITION``, ``STEERABLE_PP_MICRO_BATCHES``), so
the driver, every worker and the tests all compute the same answer without talking.

Ranks are numbered stage-major: ``rank = stage * tp_size + tp_rank``. Rank 0 is the driver.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from steerable.hook_points import POST_MLP
from steerable.step import Site, StepInput

PARTITION_ENV = "STEERABLE_PP_LAYER_PARTITION"
MICRO_BATCHES_ENV = "STEERABLE_PP_MICRO_BATCHES"


def pipeline_micro_batches(pp_size: int) -> int:
    """Batches in flight on a pipeline of ``pp_size`` stages (1: no pipeline): one per stage. More
    would cover a batch's round trip (its tokens back, its next step scheduled and launched) with
    the others' work, but each is smaller: on two H200s with the Qwen3-8B shape, 3 batches ran at
    0.92x and 4 at 0.54x the rate of 2 (docs/benchmarks.md). ``STEERABLE_PP_MICRO_BATCHES`` sets
    the number (at least ``pp_size``)."""
    if pp_size == 1:
        return 1
    text = os.environ.get(MICRO_BATCHES_ENV)
    if not text:
        return pp_size
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{MICRO_BATCHES_ENV}={text!r}: expected an integer") from None
    if value < pp_size:
        raise ValueError(f"{MICRO_BATCHES_ENV}={value}: a pipeline of {pp_size} stages needs at least {pp_size}")
    return value


def layer_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Each stage's contiguous ``[start, end)``. By default the layers are spread evenly and the
    leftovers go to the stages before the last (which also holds the final norm and the head), as
    vLLM does; ``STEERABLE_PP_LAYER_PARTITION="a,b,..."`` gives the sizes explicitly."""
    text = os.environ.get(PARTITION_ENV)
    if text:
        try:
            sizes = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"{PARTITION_ENV}={text!r}: expected comma-separated layer counts") from None
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"{PARTITION_ENV}={text!r}: needs {pp_size} positive layer counts summing to "
                             f"{num_layers}")
    else:
        if num_layers < pp_size:
            raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
        sizes = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            sizes[-2 - i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


@dataclass(frozen=True)
class Placement:
    """One rank's position: its stage, its tensor-parallel rank, and the stage's layers."""

    rank: int
    tp_size: int
    pp_size: int
    layers: tuple[int, int]  # this stage's [start, end)

    @classmethod
    def of(cls, rank: int, tp_size: int, partition: list[tuple[int, int]]) -> Placement:
        """Rank ``rank`` with ``tp_size`` ranks per stage and ``partition`` (``layer_partition``)."""
        return cls(rank, tp_size, len(partition), partition[rank // tp_size])

    @classmethod
    def single(cls, num_layers: int) -> Placement:
        return cls(0, 1, 1, (0, num_layers))

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    def stage_rank(self, stage: int, tp_rank: int = 0) -> int:
        return stage * self.tp_size + tp_rank

    def owns_layer(self, layer: int) -> bool:
        return self.layers[0] <= layer < self.layers[1]

    def owns(self, site: Site) -> bool:
        """Whether this stage runs ``site``. A layer's ``post_mlp`` add is deferred into the next
        layer's first norm (or the final norm), so it happens where that one runs: one layer later
        than the rest of the layer's sites, on the next stage for a stage's last layer."""
        point, layer = site
        start, end = self.layers
        if point == POST_MLP:
            return start - 1 <= layer < end - 1 or (self.is_last_stage and layer == end - 1)
        return start <= layer < end

    def reports(self, step: StepInput) -> bool:
        """Whether this rank sends the driver a report of ``step``: tensor-parallel rank 0 of a
        stage after the first, when it sampled or reported prompt logprobs (the last stage) or
        recorded captured rows."""
        if self.tp_rank != 0 or self.is_first_stage:
            return False
        if self.is_last_stage and (step.sampling is not None or step.prompt_logprobs):
            return True
        return step.capture is not None and any(self.owns((group.hook, layer)) for group in step.capture.groups
                                                for layer in group.layers)
