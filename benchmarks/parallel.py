"""TP=2 and PP=2 against TP=1: throughput, batch-1 latency, steering and capture costs.

Tensor and pipeline parallelism (issue 11) in one process, one engine at a time, on one
workload: throughput (``throughput.py``'s: N random requests, lengths uniform in [min, max]) for
TP=1, TP=2 and PP=2; batch-1 decode latency TP=1 vs TP=2; under TP=2 the cost of an additive
vector at every layer for every request and of capturing the last prompt token's hidden state
at every layer; and, under TP=2 with CUDA graphs, a batch mixing capturing and plain requests.
Ratios and targets are the last record.

    python -m benchmarks parallel --shape qwen3-8b [--layouts tp1,tp2,pp2] [--repeats 2]
    python -m benchmarks parallel --smoke          # CPU, gloo, tiny model
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from . import common
from .common import emit, timed

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
TARGETS = {"tp2_throughput_ratio": (">=", 1.6), "pp2_throughput_ratio": (">=", 1.5),
           "tp2_latency_ratio": ("<=", 0.65), "tp2_steering_cost_pct": ("<=", 3.0),
           "tp2_capture_cost_pct": ("<=", 5.0)}
STREAM = "hidden_states"


def progress(message: str) -> None:
    print(f"[parallel] {message}", file=sys.stderr, flush=True)


def run_modes(llm, w: common.Workload, args, modes: list[str]) -> dict[str, list[float]]:
    """Warm each mode up, then time ``repeats`` rounds of the modes in turn (alternating, so slow
    drift hits every mode alike). ``steered``: a global vector at every layer's post_mlp;
    ``captured``: a stream of the last prompt row at every layer (row counts checked)."""
    cfg = llm.engine.model_config
    layers = list(range(cfg.num_layers))
    rng = np.random.default_rng(args.seed + 1)
    vector = torch.from_numpy(rng.standard_normal(cfg.hidden_size, dtype=np.float32) * args.vector_scale)

    def once(mode: str, salt: str, warm: bool = False) -> float:
        if mode == "steered":
            llm.set_steering_vectors({"post_mlp": {layer: vector for layer in layers}})
        elif mode == "captured":
            llm.start_capture(STREAM, layers=None, select="last_prompt")
        try:
            if warm:
                common.warm_up(llm, w, args, salt)
                return 0.0
            params = common.sampling_params(w, salt)
            outs, seconds = timed(lambda: llm.generate(w.prompts, params, use_tqdm=False))
            assert common.generated_tokens(outs) == sum(w.output_lens)
        finally:
            if mode == "steered":
                llm.clear_steering_vectors()
            elif mode == "captured":
                llm.stop_capture(STREAM)
                tensors, _ = llm.fetch_captured(STREAM)
                if not warm and {int(t.shape[0]) for t in tensors.values()} != {len(w)}:
                    raise SystemExit(f"captured rows per layer {[t.shape[0] for t in tensors.values()]} != {len(w)}")
        progress(f"{salt}: {seconds:.2f} s")
        return seconds

    return common.interleaved(modes, once, args.repeats)


def decode_ms(llm, args) -> float:
    """Batch-1 decode ms/token: (t(output_len) - t(1)) / (output_len - 1), median over repeats."""
    from steerable import SamplingParams

    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, common.prompt_vocab(llm), args.input_len).tolist()
    calls = iter(range(1 << 30))

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=f"l{next(calls)}")
        return timed(lambda: llm.generate([prompt], params, use_tqdm=False))[1]

    seconds(1), seconds(args.output_len)  # warm-up
    ms = []
    for _ in range(args.latency_repeats):
        full, one = seconds(args.output_len), seconds(1)
        ms.append((full - one) / (args.output_len - 1) * 1e3)
    return common.median(ms)


def mixed_capture(llm, w: common.Workload) -> dict:
    """Half the requests capture every generated row (decode steps with a capture plan, inside
    CUDA graphs), half capture nothing: the batch completes and each capturing request gets one
    row per generated token but the last, at every layer."""
    from steerable import CaptureSpec, SamplingParams

    n, tokens = min(16, len(w)), 24
    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                             capture=CaptureSpec(select="all_generated") if i % 2 else None) for i in range(n)]
    before = llm.engine.stats()["graph_replays"]
    outs, seconds = timed(lambda: llm.generate(w.prompts[:n], params, use_tqdm=False))
    rows = {int(t.shape[0]) for o in outs[1::2] for t in o.captures[STREAM].values()}
    return {"record": "mixed_capture", "requests": n, "seconds": seconds, "rows_ok": rows == {tokens - 1},
            "plain_ok": all(not o.captures for o in outs[0::2]),
            "graph_replays": llm.engine.stats()["graph_replays"] - before}


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--layouts", default="tp1,tp2,pp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds per layout (modes alternate); medians")
    p.add_argument("--input-len", type=int, default=None, help="latency prompt length")
    p.add_argument("--output-len", type=int, default=None, help="latency output length")
    p.add_argument("--latency-repeats", type=int, default=3)
    p.add_argument("--vector-scale", type=float, default=0.05, help="std of the steering vector's entries")
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        p.error(f"--layouts: expected some of {sorted(LAYOUTS)}")
    path = common.setup("parallel", args, {"input_len": (128, 8), "output_len": (256, 16)})
    results: dict[str, dict] = {}
    for layout in layouts:
        tp, pp = LAYOUTS[layout]
        progress(f"{layout}: loading")
        llm = common.make_llm(args, path, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
        modes = ["plain", "steered", "captured"] if layout == "tp2" else ["plain"]
        times = run_modes(llm, w, args, modes)
        base = common.median(times["plain"])
        result = {"record": "throughput", "layout": layout, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                  "requests": len(w), "repeats": args.repeats, "seconds_all": times["plain"],
                  **common.throughput(base, sum(w.input_lens), sum(w.output_lens))}
        for mode in modes[1:]:
            t = common.median(times[mode])
            result[f"{mode}_seconds_all"] = times[mode]
            result[f"{mode}_cost_pct"] = (t / base - 1) * 100
        if layout in ("tp1", "tp2"):
            progress(f"{layout}: latency")
            result["decode_ms_per_token"] = decode_ms(llm, args)
        if layout == "tp2":
            emit(mixed_capture(llm, w))
        stats = llm.engine.stats()
        result.update(graph_replays=stats["graph_replays"], graph_captures=stats["graph_captures"])
        emit(result)
        results[layout] = result
        llm.shutdown()
        del llm
        common.free_cuda()
    emit(summary(results))


def summary(results: dict[str, dict]) -> dict:
    """The issue's ratios against their targets (those the layouts run allow)."""
    record: dict = {"record": "summary"}
    tp1, tp2, pp2 = (results.get(k) for k in ("tp1", "tp2", "pp2"))
    if tp1 and tp2:
        record["tp2_throughput_ratio"] = tp2["output_tok_s"] / tp1["output_tok_s"]
        record["tp2_latency_ratio"] = tp2["decode_ms_per_token"] / tp1["decode_ms_per_token"]
    if tp1 and pp2:
        record["pp2_throughput_ratio"] = pp2["output_tok_s"] / tp1["output_tok_s"]
    if tp2:
        record["tp2_steering_cost_pct"] = tp2["steered_cost_pct"]
        record["tp2_capture_cost_pct"] = tp2["captured_cost_pct"]
    for key, (op, target) in TARGETS.items():
        if key in record:
            record[f"{key}_met"] = record[key] >= target if op == ">=" else record[key] <= target
    return record

