"""Cost of capture (DESIGN.md §6) on one engine and one workload: (a) no capture, (b) a stream
recording the last prompt token's hidden state at every layer for every request, (c) the same
through a per-request ``CaptureSpec``. Row counts are checked; a wrong count exits non-zero.

    PYTHONPATH=. python benchmarks/capture_cost.py [--num-requests 256] [--repeats R]
"""

from __future__ import annotations

import common
from common import emit, timed

MODES = ("none", "stream_last_prompt", "per_request_last_prompt")
STREAM = "hidden_states"


def main() -> None:
    from steerable import CaptureSpec

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate a/b/c this many times; report medians")
    args = p.parse_args()
    path = common.setup("capture_cost", args)
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    layers = llm.list_steerable_layers()["post_mlp"]
    extras = {"none": None, "stream_last_prompt": None,
              "per_request_last_prompt": [{"capture": CaptureSpec(layers=None, select="last_prompt")}] * len(w)}
    counters = ("graph_replays", "eager_capture_forwards")

    def counts() -> dict:
        status = llm.capture_status(STREAM)
        return {k: status[k] for k in counters if k in status}

    def run(mode: str, salt: str, warm: bool = False) -> dict:
        """One generate in ``mode``, with the stream on only around it; returns the run's numbers
        and its checks (rows per layer, counter deltas)."""
        before = counts()
        if mode == "stream_last_prompt":
            llm.start_capture(STREAM, layers=None, select="last_prompt")
        try:
            if warm:
                common.warm_up(llm, w, args, salt, extras[mode])
                return {}
            params = common.sampling_params(w, salt, extras[mode])
            outs, seconds = timed(lambda: llm.generate(w.prompts, params, use_tqdm=False))
        finally:
            if mode == "stream_last_prompt":
                llm.stop_capture(STREAM)
        result = {"seconds": seconds, "output_tokens": common.generated_tokens(outs)}
        if mode == "stream_last_prompt":
            status = llm.capture_status(STREAM)
            (tensors, _), result["fetch_s"] = timed(lambda: llm.fetch_captured(STREAM))
            rows = {layer: int(tensors[layer].shape[0]) if layer in tensors else 0 for layer in layers}
            result.update(tokens_dropped=status.get("tokens_dropped"), rows_ok=set(rows.values()) == {len(w)})
        elif mode == "per_request_last_prompt":
            caps = [o.captures.get(STREAM, {}) for o in outs]
            rows = [int(c[layer].shape[0]) if layer in c else 0 for c in caps for layer in layers]
            result["rows_ok"] = set(rows) == {1}
        after = counts()
        result.update({k: after[k] - before[k] for k in after})
        return result

    for mode in MODES:
        run(mode, f"warmup-{mode}", warm=True)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for mode in MODES:
            results[mode].append(run(mode, f"{mode}-{r}"))

    base = common.median([x["seconds"] for x in results["none"]])
    ok = True
    for mode in MODES:
        runs = results[mode]
        t = common.median([x["seconds"] for x in runs])
        record = {"record": "run", "mode": mode, "requests": len(w), "layers": len(layers), "repeats": args.repeats,
                  "seconds_all": [x["seconds"] for x in runs],
                  **common.throughput(t, sum(w.input_lens), runs[-1]["output_tokens"]),
                  "cost_pct": (t / base - 1) * 100, "throughput_drop_pct": (1 - base / t) * 100}
        for key in ("fetch_s", "tokens_dropped", *counters):
            if key in runs[-1]:
                record[key] = runs[-1][key]
        if mode != "none":
            record["rows_ok"] = all(x["rows_ok"] for x in runs)
            ok &= record["rows_ok"]
        emit(record)
    emit({"record": "capture_status", **{k: v for k, v in llm.capture_status(STREAM).items() if k != "layouts"}})
    if not ok:
        raise SystemExit("captured row counts differ from one last-prompt row per request and layer")


if __name__ == "__main__":
    main()
