"""Throughput cost of capture (last prompt row, per-request specs, every generated token).

Cost of capture on one engine: (a) no capture, (b) a stream recording the last prompt token's
hidden state at every layer for every request, (c) the same through a per-request ``CaptureSpec``;
and bulk capture on the first ``--bulk-requests`` requests: (d) no capture, (e) a stream recording
every generated token at every layer in the model dtype, then ``fetch_captured`` timed (GB/s).
Costs are against (a), or (d) for (e). Row counts are checked; a wrong count exits non-zero. On a
CUDA machine each run also reports what the caching host allocator pinned during its generate
(seconds in its allocation calls, GB): pinning new row-log memory is the part of a capture run's cost that
later runs do not pay.

    python -m benchmarks capture_cost [--num-requests 256] [--bulk-requests 64] [--repeats R] [--modes M,...]
"""

from __future__ import annotations

import torch

from . import common
from .common import emit, timed

MODES = ("none", "stream_last_prompt", "per_request_last_prompt", "none_bulk", "stream_all_generated")
BASELINE = {"none": "none", "stream_last_prompt": "none", "per_request_last_prompt": "none",
            "none_bulk": "none_bulk", "stream_all_generated": "none_bulk"}
STREAM = "hidden_states"
COUNTERS = ("graph_replays", "eager_capture_forwards")


def pinned_so_far() -> dict:
    """The caching host allocator's running totals (empty without CUDA): time in its pinning calls, bytes pinned."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.host_memory_stats()
    return {"pinned_alloc_s": stats.get("host_alloc_time.total", 0) / 1e6,
            "pinned_alloc_gb": stats.get("allocated_bytes.allocated", 0) / 1e9}


def main(argv: list[str] | None = None) -> None:
    from steerable import CaptureSpec

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate the modes this many times; report medians")
    p.add_argument("--bulk-requests", type=int, default=None, help="requests of the bulk modes (d, e)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated subset of the modes (each one's baseline always runs)")
    args = p.parse_args(argv)
    chosen = set(args.modes.split(","))
    if chosen - set(MODES):
        p.error(f"unknown modes {sorted(chosen - set(MODES))}; expected some of {list(MODES)}")
    modes = [m for m in MODES if m in chosen or any(BASELINE[c] == m for c in chosen)]
    path = common.setup("capture_cost", args, {"bulk_requests": (64, 4)})
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    bulk = w.head(args.bulk_requests)
    layers = llm.list_steerable_layers()["post_mlp"]
    workloads = {m: bulk if BASELINE[m] == "none_bulk" else w for m in MODES}
    streams = {"stream_last_prompt": "last_prompt", "stream_all_generated": "all_generated"}
    extras = {"per_request_last_prompt": [{"capture": CaptureSpec(layers=None, select="last_prompt")}] * len(w)}

    def counts() -> dict:
        status = llm.capture_status(STREAM)
        return {k: status[k] for k in COUNTERS if k in status}

    def check(mode: str, outs, tensors: dict) -> bool:
        """Rows per layer: one per request (last prompt), or every generated token but the last."""
        if mode == "per_request_last_prompt":
            caps = [o.captures.get(STREAM, {}) for o in outs]
            return {int(c[layer].shape[0]) if layer in c else 0 for c in caps for layer in layers} == {1}
        expected = len(outs) if mode == "stream_last_prompt" else sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        return {int(tensors[layer].shape[0]) if layer in tensors else 0 for layer in layers} == {expected}

    def run(mode: str, salt: str, warm: bool = False) -> dict:
        """One generate in ``mode``, with the stream on only around it, then its fetch; returns the
        run's numbers and checks (rows per layer, counter deltas)."""
        work = workloads[mode]
        before, pinned_before = counts(), pinned_so_far()
        if mode in streams:
            llm.start_capture(STREAM, layers=None, select=streams[mode])
        try:
            if warm:
                common.warm_up(llm, work, args, salt, extras.get(mode))
                return {}
            params = common.sampling_params(work, salt, extras.get(mode))
            outs, seconds = timed(lambda: llm.generate(work.prompts, params, use_tqdm=False))
            pinned_after = pinned_so_far()  # during the generate (the fetch's own copy is not timed)
        finally:
            if mode in streams:
                llm.stop_capture(STREAM)
        result = {"seconds": seconds, "output_tokens": common.generated_tokens(outs),
                  "input_tokens": sum(work.input_lens)}
        tensors = {}
        if mode in streams:
            result["tokens_dropped"] = llm.capture_status(STREAM).get("tokens_dropped")
            (tensors, _), result["fetch_s"] = timed(lambda: llm.fetch_captured(STREAM))
            result["fetch_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
            result["fetch_gb_s"] = result["fetch_bytes"] / result["fetch_s"] / 1e9
            result["rows_per_layer"] = int(next(iter(tensors.values())).shape[0]) if tensors else 0
        if mode != "none" and mode != "none_bulk":
            result["rows_ok"] = check(mode, outs, tensors)
        after = counts()
        result.update({k: after[k] - before[k] for k in after})
        result.update({k: pinned_after[k] - pinned_before[k] for k in pinned_after})
        return result

    results = common.interleaved(modes, run, args.repeats)

    ok = True
    for mode in modes:
        runs = results[mode]
        t = common.median([x["seconds"] for x in runs])
        base = common.median([x["seconds"] for x in results[BASELINE[mode]]])
        record = {"record": "run", "mode": mode, "baseline": BASELINE[mode], "requests": len(workloads[mode]),
                  "layers": len(layers), "repeats": args.repeats, "seconds_all": [x["seconds"] for x in runs],
                  **common.throughput(t, runs[-1]["input_tokens"], runs[-1]["output_tokens"]),
                  "cost_pct": (t / base - 1) * 100, "throughput_drop_pct": (1 - base / t) * 100}
        if "fetch_s" in runs[-1]:
            record.update(fetch_s=common.median([x["fetch_s"] for x in runs]),
                          fetch_gb_s=common.median([x["fetch_gb_s"] for x in runs]),
                          fetch_s_all=[x["fetch_s"] for x in runs], fetch_bytes=runs[-1]["fetch_bytes"],
                          rows_per_layer=runs[-1]["rows_per_layer"])
        for key in ("pinned_alloc_s", "pinned_alloc_gb"):
            if key in runs[-1]:
                record[f"{key}_all"] = [x[key] for x in runs]
        for key in ("tokens_dropped", *COUNTERS):
            if key in runs[-1]:
                record[key] = runs[-1][key]
        if "rows_ok" in runs[-1]:
            record["rows_ok"] = all(x["rows_ok"] for x in runs)
            ok &= record["rows_ok"]
        emit(record)
    emit({"record": "capture_status", **{k: v for k, v in llm.capture_status(STREAM).items() if k != "layouts"}})
    if not ok:
        raise SystemExit("captured row counts differ from the expected rows per request and layer")

