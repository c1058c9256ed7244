"""Throughput cost of attention-pattern capture against none.

Cost of attention-pattern capture on one engine and one workload, each mode against no capture
in the same process: (a) no capture, (b) one layer's patterns (every head) for the last prompt
token of every request, (c) every layer's patterns for every generated token of the first
``--pattern-requests`` requests (the others capture nothing). Cost = (t_x / t_a - 1) * 100, from
median times; rows and key lengths are checked, a wrong count exits non-zero.

    python -m benchmarks pattern_cost [--layer 14] [--pattern-requests 16] [--repeats 3]
"""

from __future__ import annotations

from . import common
from .common import emit, timed

MODES = ("none", "last_prompt_one_layer", "all_layers_generated")
STREAM = "attention_patterns"


def main(argv: list[str] | None = None) -> None:
    from steerable import CaptureSpec

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate the modes this many times; report medians")
    p.add_argument("--layer", type=int, default=None, help="the layer of mode (b) (default 14; --smoke 1)")
    p.add_argument("--pattern-requests", type=int, default=None, help="requests of mode (c) (default 16; --smoke 2)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes ('none' always runs)")
    args = p.parse_args(argv)
    modes = ["none", *[m for m in args.modes.split(",") if m != "none"]]
    if set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(set(modes) - set(MODES))}; expected some of {list(MODES)}")
    path = common.setup("pattern_cost", args, {"layer": (14, 1), "pattern_requests": (16, 2)})
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    layers = list(range(llm.engine.model_config.num_layers))
    k = min(args.pattern_requests, len(w))
    last = CaptureSpec(stream=STREAM, layers=[args.layer], select="last_prompt")
    every = CaptureSpec(stream=STREAM, layers=layers, select="all_generated")
    extras = {"last_prompt_one_layer": [{"capture": last}] * len(w),
              "all_layers_generated": [{"capture": every}] * k + [{}] * (len(w) - k)}

    def check(mode: str, outs) -> int:
        """Rows recorded; exits if a request's rows or key lengths are not what its spec asks."""
        rows = 0
        for i, out in enumerate(outs):
            pats = out.captures.get(STREAM, {})
            want = {"none": {}, "last_prompt_one_layer": {args.layer: [w.input_lens[i]]},
                    "all_layers_generated": {L: list(range(w.input_lens[i] + 1, w.input_lens[i] + len(
                        out.outputs[0].token_ids))) for L in layers} if i < k else {}}[mode]
            if sorted(pats) != sorted(want):
                raise SystemExit(f"{mode}: request {i} captured layers {sorted(pats)}, expected {sorted(want)}")
            for layer, key_lens in want.items():
                if pats[layer].key_lens.tolist() != key_lens:
                    raise SystemExit(f"{mode}: request {i} layer {layer}: wrong rows")
                rows += len(key_lens)
        return rows

    def run(mode: str, salt: str, warm: bool = False) -> dict:
        if warm:
            common.warm_up(llm, w, args, salt, extras.get(mode))
            return {}
        outs, seconds = timed(lambda: llm.generate(w.prompts, common.sampling_params(w, salt, extras.get(mode)),
                                                   use_tqdm=False))
        return {"seconds": seconds, "tokens": common.generated_tokens(outs), "rows": check(mode, outs)}

    results = common.interleaved(modes, run, args.repeats)
    base = common.median([r["seconds"] for r in results["none"]])
    for mode in modes:
        t = common.median([r["seconds"] for r in results[mode]])
        emit({"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats,
              "seconds_all": [r["seconds"] for r in results[mode]], "pattern_rows": results[mode][-1]["rows"],
              **common.throughput(t, sum(w.input_lens), results[mode][-1]["tokens"]), "cost_pct": (t / base - 1) * 100})

