"""Throughput cost of steering (global, per-request, clamps, mixed configs) against none.

Cost of steering on one engine and one workload: (a) no steering, (b) one global additive vector
at every layer for every request, (c) a distinct per-request vector at every layer for every
request (N configs in one batch), (d) a global projection clamp at every layer, (e) N distinct
per-request configs mixing adds, clamps, ablations and selections (prompt-only, decode-only,
generation windows) at all three hook points, (f) N distinct per-request rank-4 LoReFTs
(``LowRank``) at one layer (issue 51: <= 10 %), (g) one global ``When(scope="token")`` gating an add
at every layer (issue 51: <= 5 %). Cost = (t_x / t_a - 1) * 100, from median times.

    python -m benchmarks steering_cost [--num-requests 256] [--repeats R] [--modes ...]
"""

from __future__ import annotations

import gc
import time
from functools import partial

import numpy as np
import torch

from . import common
from .common import emit, timed

MODES = ("none", "global_all_layers", "per_request_distinct", "global_clamp_all_layers", "mixed_distinct",
         "lowrank_distinct", "when_token_all_layers")
LOWRANK_RANK = 4


def mixed_config(i: int, layers: list[int], vector: torch.Tensor, direction: torch.Tensor) -> object:
    """Request i's own config: one of four shapes, each at every layer, all vectors distinct."""
    from steerable import Add, Clamp, SelectSpec, SteeringSpec

    kind = i % 4
    if kind == 0:  # an add at every layer, and a clamp on the layer outputs
        items = [Add(layer, vector) for layer in layers] + [Clamp(layer, direction, min=-1.0, max=1.0)
                                                            for layer in layers]
    elif kind == 1:  # prompt-only adds before attention, decode-only clamps after it
        items = [Add(layer, vector, hook="pre_attn", select=SelectSpec(prompt="all")) for layer in layers] + \
                [Clamp(layer, direction, hook="post_attn", min=-0.5, max=0.5, select=SelectSpec(generation="all"))
                 for layer in layers]
    elif kind == 2:  # ablate a direction everywhere
        items = [Clamp(layer, direction, min=0.0, max=0.0) for layer in layers]
    else:  # an add for the first 64 generated tokens only
        items = [Add(layer, vector, hook="post_attn", select=SelectSpec(generation_window=(0, 64)))
                 for layer in layers]
    return SteeringSpec(interventions=items)


def lowrank_config(layer: int, hidden: int, rng: np.random.Generator, scale: float) -> object:
    """One request's own rank-4 LoReFT at ``layer``: orthonormal rows R, small W and b."""
    from steerable import LowRank, SteeringSpec

    R = np.linalg.qr(rng.standard_normal((hidden, LOWRANK_RANK)))[0].T.astype(np.float32)
    W = (rng.standard_normal((LOWRANK_RANK, hidden)) * scale).astype(np.float32)
    b = (rng.standard_normal(LOWRANK_RANK) * scale).astype(np.float32)
    return SteeringSpec(interventions=[LowRank(layer, R, W, b)])


def mode_steering(llm, w, args) -> tuple[dict, dict]:
    """(global spec of each mode that sets one, per-request extras of each mode that has them) for
    the workload ``w``: every vector and direction drawn from ``args.seed``."""
    from steerable import Add, Clamp, SteeringSpec, When

    cfg = llm.engine.model_config
    layers = llm.list_steerable_layers()["post_mlp"]
    rng = np.random.default_rng(args.seed + 1)
    shared = torch.from_numpy(rng.standard_normal(cfg.hidden_size, dtype=np.float32) * args.vector_scale)
    own = torch.from_numpy(rng.standard_normal((len(w), cfg.hidden_size), dtype=np.float32) * args.vector_scale)
    directions = torch.nn.functional.normalize(torch.from_numpy(
        rng.standard_normal((len(w) + 1, cfg.hidden_size), dtype=np.float32)), dim=-1)
    # The gate reads the embeddings (pre_attn 0), so the adds at every layer's output sit after it;
    # threshold 0 on a random direction passes about half the rows.
    gated = When([Add(layer, shared) for layer in layers], 0, directions[-1], 0.0, hook="pre_attn")
    global_specs = {"global_all_layers": {"post_mlp": {layer: shared for layer in layers}},
                    "global_clamp_all_layers": SteeringSpec(clamps=[Clamp(layer, directions[-1], min=-1.0, max=1.0)
                                                                    for layer in layers]),
                    "when_token_all_layers": SteeringSpec(interventions=[gated])}
    extras = {"per_request_distinct": [{"steering_vectors": {"post_mlp": {layer: own[i] for layer in layers}}}
                                       for i in range(len(w))],
              "mixed_distinct": [{"steering_vectors": mixed_config(i, layers, own[i], directions[i])}
                                 for i in range(len(w))],
              "lowrank_distinct": [{"steering_vectors": lowrank_config(layers[len(layers) // 2], cfg.hidden_size, rng,
                                                                       args.vector_scale)} for _ in range(len(w))]}
    return global_specs, extras


class Breakdown:
    """Where a run's wall time goes: engine steps that only decode and the others (prefill
    chunks), the host time of checking requests (``generate`` checks every prompt up front, tokens
    and steering specs: ``check_s``) and of admitting them (it queues them and the scheduler
    builds their state inside steps, so ``admit_s`` is part of the steps' time) and the garbage
    collector's passes. With asynchronous scheduling a step's wall time is the longer of its host
    work and the previous step's device work, so a mode's extra seconds show up in the kind of
    step that pays them."""

    def __init__(self, engine) -> None:
        self.engine, self.totals = engine, {}
        self._gc_start = 0.0
        step = engine.step

        def timed(key: str, fn):
            def run(*a, **k):
                start = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self._count(key, time.perf_counter() - start)
            return run

        schedule, launched = engine.scheduler.schedule, ["decode"]

        def noted_schedule():  # the kind of step a step launches: one token a request, or more
            out = schedule()
            launched[0] = "decode" if all(s.num_tokens == 1 for s in out.scheduled) else "other"
            return out

        def timed_step(*a, **k):
            launched[0] = "decode"  # a step that launches nothing only collects the last one
            start = time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                self._count(f"{launched[0]}_s", time.perf_counter() - start)
                self._count(f"{launched[0]}_steps", 1)

        engine._check, engine._admit_checked = timed("check_s", engine._check), timed("admit_s", engine._admit_checked)
        engine.step, engine.scheduler.schedule = timed_step, noted_schedule
        gc.callbacks.append(self._on_gc)

    def _count(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0) + value

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._count("gc_s", time.perf_counter() - self._gc_start)
            self._count(f"gc_gen{info['generation']}", 1)

    def take(self) -> dict:
        """The totals since the last call."""
        totals, self.totals = self.totals, {}
        return totals


def add_arguments(p) -> None:
    p.add_argument("--vector-scale", type=float, default=0.05, help="std of the random vectors' entries")


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate the modes this many times; report medians")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes ('none' always runs)")
    p.add_argument("--breakdown", action="store_true",
                   help="time admission, decode-only and other steps, and garbage collection per run")
    add_arguments(p)
    args = p.parse_args(argv)
    modes = ["none", *[m for m in args.modes.split(",") if m != "none"]]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; expected some of {list(MODES)}")
    path = common.setup("steering_cost", args)
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    global_specs, extras = mode_steering(llm, w, args)

    def in_mode(mode: str, fn):
        """Run ``fn`` with the global spec of ``mode`` set (if any), cleared afterwards whatever happens."""
        if mode in global_specs:
            llm.set_steering_vectors(global_specs[mode])
        try:
            return fn()
        finally:
            llm.clear_steering_vectors()

    # Steered paths (tables, kernels, graphs) get warmed too, until a pass leaves the steering tables'
    # layout as it found it: a later mode that adds a site or widens a table makes the graphs of the
    # modes warmed before it stale, and they would be captured again inside a timed run.
    steering = llm.llm_engine.steering
    for passes in range(1, 4):
        version = steering.tables.version + steering.edits.version
        for mode in modes:
            in_mode(mode, partial(common.warm_up, llm, w, args, f"warmup-{mode}-{passes}", extras.get(mode)))
        if steering.tables.version + steering.edits.version == version:
            break
    else:
        raise SystemExit("the steering tables' layout still changed in the third warm-up pass")
    emit({"record": "warmup", "passes": passes, "steering_table_version": version})

    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    graphs: dict[str, list[dict[str, int]]] = {m: [] for m in modes}  # graph captures/replays in timed runs
    breakdown = Breakdown(llm.llm_engine) if args.breakdown else None
    parts: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            params = common.sampling_params(w, f"{mode}-{r}", extras.get(mode))
            if breakdown is not None:
                breakdown.take()
            before = llm.llm_engine.stats()
            outs, seconds = in_mode(mode, partial(timed, partial(llm.generate, w.prompts, params, use_tqdm=False)))
            after = llm.llm_engine.stats()
            graphs[mode].append({k: after[k] - before[k] for k in ("graph_captures", "graph_replays", "num_steps")})
            times[mode].append(seconds)
            tokens[mode] = common.generated_tokens(outs)
            if breakdown is not None:
                parts[mode].append(breakdown.take())
    base = common.median(times["none"])
    for mode in modes:
        t = common.median(times[mode])
        record = {"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats,
                  "seconds_all": times[mode], "graphs_all": graphs[mode],
                  **common.throughput(t, sum(w.input_lens), tokens[mode])}
        record.update(cost_pct=(t / base - 1) * 100, throughput_drop_pct=(1 - base / t) * 100)
        if parts[mode]:
            record["breakdown"] = {key: common.median([run.get(key, 0) for run in parts[mode]])
                                   for key in sorted(set().union(*parts[mode]))}
        emit(record)
    status = llm.get_steering_status()
    ok = status.get("rows_in_use") == 0 and status.get("configs_in_use", 0) == 0
    emit({"record": "steering_status", "ok": ok, **status})
    if not ok:
        raise SystemExit("steering rows still in use after every request finished")

