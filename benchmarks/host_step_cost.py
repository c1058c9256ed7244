"""Host time of ``steering_cost``'s modes on a CPU, the forward taken out.

Host time of steering on a CPU, with the forward taken out: a random Qwen3 of Qwen3-0.6B's depth
and hidden size (28 layers of 1024, so every per-site cost and table row counts as there), every
other width tiny, running steering_cost's modes on a workload of its shape. On a GPU the decode steps replay CUDA graphs and the
host thread is the bottleneck, so what a mode adds here (admission, scheduling, step building,
steering plans and table uploads, output bookkeeping) is what it adds to the wall time there.

Per mode (medians over ``--repeats`` passes): admission ms (every ``add_request``) and per step the
wall time of ``engine.step`` less the sampler's (device work on a GPU), the forward replaced by
zeros: the mean of every step, the median of decode-only steps (graph replays on a GPU) and the
mean of the others; ``total_host_ms`` is admission plus every step.

    python -m benchmarks host_step_cost [--num-requests 256] [--repeats 3]
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from . import common, steering_cost
from .common import emit

# Qwen3-0.6B's depth and hidden size (the steering tables' shape), every other width tiny.
SHAPE = dict(common.QWEN3_SMOKE, num_hidden_layers=28, hidden_size=1024, intermediate_size=64,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024)


def stub_device(runner: Any) -> list[float]:
    """Replace the runner's forward program by zeros (a decode step on a GPU replays it from a CUDA
    graph: no host work) and time its sampler (device work there), whose seconds add up in the
    list returned."""
    spent = [0.0]
    hidden = runner.model_config.hidden_size
    sample = runner._sample

    def forward(ctx: Any, views: Any, inside: bool) -> tuple[torch.Tensor, None]:
        return torch.zeros(views.input_ids.shape[0], hidden, dtype=runner.dtype), None

    def timed_sample(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return sample(*args)
        finally:
            spent[0] += time.perf_counter() - start

    runner._program = forward
    runner._sample = timed_sample
    return spent


def run_mode(llm, w: common.Workload, params: list, device: list[float], salt: str) -> dict[str, float]:
    """One pass of the workload: admission ms, and host ms per step (all, decode-only, the others)."""
    engine = llm.llm_engine
    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(w.prompts, params)):
        engine.add_request(f"{salt}-{i}", prompt, p)
    admit = time.perf_counter() - start
    decode, other = [], []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        decode_only = not sched.waiting and all(r.num_tokens - r.num_computed_tokens <= 1 for r in sched.running)
        before = device[0]
        start = time.perf_counter()
        engine.step()
        host = time.perf_counter() - start - (device[0] - before)
        (decode if decode_only else other).append(host * 1e3)
    steps = decode + other
    return {"admit_ms": admit * 1e3, "steps": len(steps), "step_host_ms": statistics.fmean(steps),
            "decode_host_ms": statistics.median(decode), "other_host_ms": statistics.fmean(other or [0.0]),
            "total_host_ms": admit * 1e3 + sum(steps)}


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="alternate the modes this many times; report medians")
    p.add_argument("--modes", default="mixed_distinct", help="comma-separated modes of steering_cost ('none' always runs)")
    steering_cost.add_arguments(p)
    p.set_defaults(device="cpu", dtype="float32", max_num_batched_tokens=2048)
    args = p.parse_args(argv)
    modes = ["none", *[m for m in args.modes.split(",") if m != "none"]]
    if set(modes) - set(steering_cost.MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(steering_cost.MODES))}; expected some of {steering_cost.MODES}")
    common.setup("host_step_cost", args, {"num_requests": (256, 8), "min_len": (8, 4), "max_len": (128, 16),
                                          "kv_cache_tokens": (65536, 4096)}, model=False)
    name = "qwen3-host-smoke" if args.smoke else "qwen3-host"
    shape = dict(SHAPE, hidden_size=64) if args.smoke else SHAPE
    path = args.model or common.build_random_model(os.path.join(args.cache_dir, name), "Qwen3Config", shape)
    args.load_format = "auto"
    llm = common.make_llm(args, path, cpu_threads=1)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    global_specs, extras = steering_cost.mode_steering(llm, w, args)
    device = stub_device(llm.llm_engine.worker)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(-1, args.repeats):  # round -1 warms up
        for mode in modes:
            if mode in global_specs:
                llm.set_steering_vectors(global_specs[mode])
            try:
                params = common.sampling_params(w, f"{mode}-{r}", extras.get(mode))
                record = run_mode(llm, w, params, device, f"{mode}-{r}")
            finally:
                llm.clear_steering_vectors()
            if r >= 0:
                results[mode].append(record)
    base = statistics.median(run["total_host_ms"] for run in results[modes[0]])
    for mode in modes:
        runs = results[mode]
        record = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        emit({"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats, **record,
              "extra_host_ms": record["total_host_ms"] - base})

