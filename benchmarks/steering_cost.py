"""Cost of steering (DESIGN.md §6) on one engine and one workload: (a) no steering, (b) one global
additive vector at every layer for every request, (c) a distinct per-request vector at every layer
for every request (N configs in one batch). Cost = (t_x / t_a - 1) * 100, from median times.

    PYTHONPATH=. python benchmarks/steering_cost.py [--num-requests 256] [--repeats R]
"""

from __future__ import annotations

from functools import partial

import common
import numpy as np
import torch
from common import emit, timed

MODES = ("none", "global_all_layers", "per_request_distinct")


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate a/b/c this many times; report medians")
    p.add_argument("--vector-scale", type=float, default=0.05, help="std of the random vectors' entries")
    args = p.parse_args()
    path = common.setup("steering_cost", args)
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    cfg = llm.engine.model_config
    layers = llm.list_steerable_layers()["post_mlp"]
    rng = np.random.default_rng(args.seed + 1)
    shared = torch.from_numpy(rng.standard_normal(cfg.hidden_size, dtype=np.float32) * args.vector_scale)
    own = torch.from_numpy(rng.standard_normal((len(w), cfg.hidden_size), dtype=np.float32) * args.vector_scale)

    extras = {"none": None, "global_all_layers": None,
              "per_request_distinct": [{"steering_vectors": {"post_mlp": {layer: own[i] for layer in layers}}}
                                       for i in range(len(w))]}

    def in_mode(mode: str, fn):
        """Run ``fn`` with the global spec set for mode (b) only, cleared afterwards whatever happens."""
        if mode == "global_all_layers":
            llm.set_steering_vectors({"post_mlp": {layer: shared for layer in layers}})
        try:
            return fn()
        finally:
            llm.clear_steering_vectors()

    for mode in MODES:  # steered paths (tables, kernels, graphs) get warmed too
        in_mode(mode, partial(common.warm_up, llm, w, args, f"warmup-{mode}", extras[mode]))

    times: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        for mode in MODES:
            params = common.sampling_params(w, f"{mode}-{r}", extras[mode])
            outs, seconds = in_mode(mode, partial(timed, partial(llm.generate, w.prompts, params, use_tqdm=False)))
            times[mode].append(seconds)
            tokens[mode] = common.generated_tokens(outs)
    base = common.median(times["none"])
    for mode in MODES:
        t = common.median(times[mode])
        record = {"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats,
                  "seconds_all": times[mode],
                  **common.throughput(t, sum(w.input_lens), tokens[mode])}
        record.update(cost_pct=(t / base - 1) * 100, throughput_drop_pct=(1 - base / t) * 100)
        emit(record)
    status = llm.get_steering_status()
    ok = status.get("rows_in_use") == 0 and status.get("configs_in_use", 0) == 0
    emit({"record": "steering_status", "ok": ok, **status})
    if not ok:
        raise SystemExit("steering rows still in use after every request finished")


if __name__ == "__main__":
    main()
