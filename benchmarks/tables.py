"""The figures docs/benchmarks.md shows, table by table (``python -m benchmarks report`` renders them).

A ``Figure`` names the record that holds a number; the report takes the newest one of each card.
To show a new figure, add it here, commit the run's records and run the report. ``where`` keeps
a figure to its workload (the defaults of the benchmark), so a run with other arguments does not
replace it; the goals are DESIGN.md §6's and the issues', on the card they were set for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .results import Run


@dataclass(frozen=True)
class Goal:
    """A target: how the docs write it and the test a figure must pass."""

    text: str
    met: Callable[[float], bool]


def at_least(bound: float, text: str) -> Goal:
    return Goal(text, lambda value: value >= bound)


def at_most(bound: float, text: str) -> Goal:
    return Goal(text, lambda value: value <= bound)


@dataclass(frozen=True)
class Figure:
    """One line of a table: a number read from the newest matching record of each card."""

    what: str
    bench: str
    record: str
    value: str  # the record's field that holds the number
    fmt: Callable[[float], str]
    where: Mapping[str, Any] = field(default_factory=dict)  # record fields, header fields or run arguments
    detail: Callable[[Run, dict], str | None] | None = None  # more of the same run, after the number
    goal: Goal | None = None
    card: str | None = None  # a goal set on one card (``card_label``, ``CPU`` for any processor): only its runs count


@dataclass(frozen=True)
class Table:
    name: str
    figures: tuple[Figure, ...]


H200 = "H200"  # the card of DESIGN.md §6's absolute targets


# ---------------------------------------------------------------- formats of a figure's number

tok_s = "{:,.0f} tok/s".format
cost = "{:+.1f} %".format
times = "{:.2f}×".format
ms_token = "{:.3f} ms/token".format
seconds = "{:.2f} s".format
ms = "{:.1f} ms".format


def pct(v: float) -> str:
    return f"{v * 100:.1f} %"


def pct_fine(v: float) -> str:
    """A small share (an overhead): two decimals."""
    return f"{v * 100:.2f} %"


# ---------------------------------------------------------------- details from the same run

def runs_and_roofline(run: Run, r: dict) -> str:
    """The timed runs' spread and, where the run has it, the step's share of its byte roofline."""
    spread = r.get("seconds_all") or [r["seconds"]]
    text = f"{min(spread):.2f}-{max(spread):.2f} s" if len(spread) > 1 else f"{spread[0]:.2f} s"
    roof = run.first("roofline", enforce_eager=r.get("enforce_eager", False))
    return text + (f"; {pct(roof['fraction_of_roofline'])} of its roofline" if roof else "")


Detail = Callable[[Run, dict], "str | None"]


def against(baseline: str) -> Detail:
    """The median seconds of a mode against its baseline mode's in the same run."""
    def detail(run: Run, r: dict) -> str | None:
        base = run.first("run", mode=r.get("baseline", baseline))
        return f"{r['seconds']:.2f} s against {base['seconds']:.2f} s" if base else None
    return detail


def fetch(run: Run, r: dict) -> str:
    speed = f"fetch {r['fetch_gb_s']:.0f} GB/s" if "fetch_gb_s" in r else None
    return "; ".join(filter(None, [against("none_bulk")(run, r), speed]))


def roofline_step(run: Run, r: dict) -> str:
    return f"{r['measured_step_ms']:.2f} ms a step against {r['roofline_step_ms']:.2f} ms"


def serve_detail(run: Run, r: dict) -> str | None:
    served, offline = run.first("serve"), run.first("offline")
    if not (served and offline):
        return None
    return (f"{served['output_tok_s']:,.0f} against {offline['output_tok_s']:,.0f} tok/s offline; "
            f"TTFT p50 {served['ttft_ms_p50']:.0f} ms, ITL p50 {served['itl_ms_p50']:.2f} ms")


def serve_c1_detail(run: Run, r: dict) -> str | None:
    served, offline = run.first("serve"), run.first("offline")
    if not (served and offline):
        return None
    return f"ITL p50 {served['itl_ms_p50']:.3f} ms against {offline['decode_ms_per_token']:.3f} ms/token alone"


def corpus_detail(run: Run, r: dict) -> str | None:
    if "steerable_median_s" in r:
        return f"medians of {r['repeats']}: {r['steerable_median_s']:.2f} s against HF {r['hf_median_s']:.2f} s"
    ours, hf = run.first("run", mode="steerable"), run.first("run", mode="hf")
    return f"{ours['seconds']:.2f} s against HF {hf['seconds']:.2f} s" if ours and hf else None


def stream_detail(run: Run, r: dict) -> str | None:
    """activation_stream: both modes' training speeds and the trainer's shape."""
    return (f"{r['stream_tok_s']:,.0f} against {r['cache_tok_s']:,.0f} tok/s; {r['trainer']} trainer, "
            f"d_sae {r['d_sae']:,}, k {r['k']}, batches of {r['batch_size']:,}")


def writer_detail(run: Run, r: dict) -> str:
    return (f"{r['saelens_tok_s']:,.0f} tok/s against {r['prefill_tok_s']:,.0f} prefill, HF "
            f"{r['hf_best_tok_s']:,.0f} at batch {r['hf_best_batch_size']}; {r['store_dtype']}")


def shard_parts(run: Run, r: dict) -> str:
    return (f"{r['capture_ms_per_shard'] / 1e3:.1f} s capture a shard; scheduling {r['scheduling_ms_per_shard']:.1f}, "
            f"write {r['write_ms_per_shard']:.1f}, commit {r['commit_ms_per_shard']:.1f} ms")


def chat_detail(run: Run, r: dict) -> str | None:
    off, on, shared = (run.first("run", mode=m) for m in ("cache_off", "cache_on", "shared"))
    if not (off and on and shared):
        return None
    return (f"{shared['seconds']:.2f} s against {off['seconds']:.2f} s off, {on['seconds']:.2f} s on; "
            f"{shared['shared_prefix_steps']} of {shared['num_steps']} steps shared")


def duel_detail(run: Run, r: dict) -> str:
    """cpu_duel: both engines' median speeds (ms per token at batch 1) and whether tokens matched."""
    if "steerable_ms_per_token" in r:
        speeds = f"{r['steerable_ms_per_token']:.1f} against {r['vllm_ms_per_token']:.1f} ms/token"
    else:
        speeds = f"{r['steerable_output_tok_s']:.0f} against {r['vllm_output_tok_s']:.0f} tok/s"
    same = "tokens identical" if r["tokens_identical"] else "tokens differ"
    return f"{speeds}, medians of {r['repeats']} ABBA rounds; {same}"


def chat_ratio_detail(run: Run, r: dict) -> str | None:
    """The chat benchmark's plain mode against caching off and shared-prefix attention off."""
    plain, off, on = (run.first("run", mode=m) for m in ("plain", "cache_off", "shared_prefix_off"))
    if not (plain and off):
        return None
    shared = plain["shared_prefix_steps"][-1], plain["num_steps"][-1]
    return (f"{plain['seconds']:.2f} s against {off['seconds']:.2f} s off"
            + (f", {on['seconds']:.2f} s without shared-prefix attention" if on else "")
            + f"; {shared[0]} of {shared[1]} steps shared")


def chat_mode_detail(run: Run, r: dict) -> str | None:
    """A chat mode's output tok/s and its engine counters (the last round's) beside plain's."""
    mode, plain = run.first("run", mode=r["mode"]), run.first("mode", mode="plain")
    if not (mode and plain):
        return None
    eager = mode["capture_eager_steps"][-1]
    return (f"{r['output_tok_s']:,.0f} against {plain['output_tok_s']:,.0f} tok/s"
            + (f"; {eager} steps captured without a graph" if eager else ""))


def dashboards_detail(run: Run, r: dict) -> str:
    speed = {m["mode"]: m["prompt_tok_s"] for _, m in run.records if m.get("record") == "run"}
    return (f"{speed['dashboards']:,.0f} against {speed['sparse_capture']:,.0f} tok/s, "
            f"{r['tokens_seen']:,} tokens, mean L0 {r['mean_l0']:.0f}")


def steered(run: Run, r: dict) -> str | None:
    s = run.first("latency", mode="steered")
    return f"steered {s['overhead_pct']:+.1f} %" if s else None


def shard(run: Run, r: dict) -> str:
    return f"{r['gb']:.1f} GB at {r['gb_s']:.1f} GB/s"


def positions(run: Run, r: dict) -> str:
    return f"{r['positions']} positions of {r['prompts']} prompts, {run.header.get('model')}"


def admission(run: Run, r: dict) -> str | None:
    none = run.first("run", mode="none")
    return f"unsteered {none['admit_ms']:.1f} ms; {r['extra_host_ms']:+.0f} ms of host time a run" if none else None


# ---------------------------------------------------------------- tables

DENSE = {"shape": "qwen3-0.6b", "num_requests": 256, "enforce_eager": False}
BF16 = {**DENSE, "kv_cache_dtype": "auto"}
STEERING = {"shape": "qwen3-0.6b", "num_requests": 256}
CHAT = {"shape": "qwen3-0.6b", "num_requests": 512, "system_len": 1200}
SAELENS = {"shape": "qwen3-0.6b", "context_size": 128}


def _throughput(shape: str, **where) -> dict:
    return {**BF16, "shape": shape, **where}


TARGETS = Table("targets", (
    Figure("offline throughput, Qwen3-0.6B shape, 256 requests", "throughput", "steerable", "output_tok_s", tok_s,
           BF16, runs_and_roofline, at_least(25_000, "≥ 25k"), H200),
    Figure("… against HF `generate` in the same run", "throughput", "ratio", "output_tok_s_ratio", times,
           {"shape": "qwen3-0.6b"}, goal=at_least(10, "≥ 10×")),
    Figure("a vector at every layer, every request", "steering_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "global_all_layers"}, against("none"), at_most(3, "≤ 3 %")),
    Figure("256 distinct per-request vectors at every layer", "steering_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "per_request_distinct"}, against("none"), at_most(10, "≤ 10 %")),
    Figure("256 distinct mixed configs (adds, clamps, ablations, selections)", "steering_cost", "run", "cost_pct",
           cost, {**STEERING, "mode": "mixed_distinct"}, against("none"), at_most(10, "≤ 10 %")),
    Figure("256 distinct rank-4 LoReFTs at one layer", "steering_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "lowrank_distinct"}, against("none"), at_most(10, "≤ 10 %")),
    Figure("one `When(scope=\"token\")` gating a vector at every layer", "steering_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "when_token_all_layers"}, against("none"), at_most(5, "≤ 5 %")),
    Figure("capture of the last prompt row at every layer, a stream", "capture_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "stream_last_prompt"}, against("none"), at_most(5, "≤ 5 %")),
    Figure("… per-request `CaptureSpec`", "capture_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "per_request_last_prompt"}, against("none"), at_most(5, "≤ 5 %")),
    Figure("batch-1 decode", "latency", "latency", "decode_ms_per_token", ms_token,
           {"shape": "qwen3-0.6b", "mode": "unsteered"}, steered, at_most(0.9, "≤ 0.9 ms"), H200),
    Figure("server at saturation, of offline output tok/s", "serve", "ratio", "output_tok_s_ratio", times,
           {"shape": "qwen3-0.6b", "max_concurrency": None, "request_rate": None}, serve_detail,
           at_least(0.9, "≥ 0.9×")),
    Figure("server ITL at concurrency 1, of offline", "serve", "ratio", "itl_p50_over_offline_ms_per_token", times,
           {"shape": "qwen3-0.6b", "max_concurrency": 1}, serve_c1_detail, at_most(1.15, "≤ 1.15×")),
    Figure("TP=2 throughput, Qwen3-8B shape, of TP=1", "parallel", "summary", "tp2_throughput_ratio", times,
           {"shape": "qwen3-8b"}, goal=at_least(1.6, "≥ 1.6×")),
    Figure("TP=2 batch-1 ms/token, of TP=1", "parallel", "summary", "tp2_latency_ratio", times,
           {"shape": "qwen3-8b"}, goal=at_most(0.65, "≤ 0.65×")),
    Figure("PP=2 throughput, of TP=1", "parallel", "summary", "pp2_throughput_ratio", times,
           {"shape": "qwen3-8b"}, goal=at_least(1.5, "≥ 1.5×")),
    Figure("corpus capture to shards, of HF `output_hidden_states`", "capture_corpus", "ratio",
           "prompt_tok_s_ratio", times, {"shape": "qwen3-0.6b"}, corpus_detail,
           at_least(10, "≥ 10×")),
    Figure("MoE, Qwen3-30B-A3B shape", "throughput", "steerable", "output_tok_s", tok_s,
           _throughput("qwen3-30b-a3b"), runs_and_roofline, at_least(5_000, "≥ 5k"), H200),
    Figure("SAELens cache, one layer, windows of 128, of the engine's own prefill", "saelens_cache", "ratio",
           "of_prefill", pct, SAELENS, writer_detail, at_least(0.8, "≥ 80 %")),
    Figure("… over HF `output_hidden_states` at its best batch size", "saelens_cache", "ratio", "over_hf", times,
           SAELENS, writer_detail, at_least(3, "≥ 3×")),
    Figure("top-k SAE training fed by ActivationStream, of the same trainer reading a SAELens cache",
           "activation_stream", "ratio", "stream_over_cache", pct, {}, stream_detail, at_least(0.7, "≥ 70 %")),
    Figure("corpus shard overhead (scheduling, write, commit), of its capture time", "corpus_shards", "run",
           "overhead_fraction", pct_fine, {"mode": "many"}, shard_parts, at_most(0.02, "≤ 2 %"), "CPU"),
    Figure("512 chats sharing a 1,200-token system prompt, over caching off", "chat", "ratio",
           "speedup_vs_cache_off", times, CHAT, chat_ratio_detail, at_least(2, "≥ 2×")),
    Figure("SAE (65,536 features) top-32 capture of every token", "sae_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "capture_top_k_every_token"}, against("none"), at_most(20, "≤ 20 %")),
    Figure("256 feature-steering configs", "sae_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "feature_steering_distinct"}, against("none"), at_most(10, "≤ 10 %")),
    Figure("transcoder (16,384 features) top-32 capture of every token", "sae_cost", "run", "cost_pct", cost,
           {**STEERING, "mode": "transcoder_capture_top_k_every_token"}, against("none"), at_most(20, "≤ 20 %")),
    Figure("chat workload, last-prompt capture at every layer, below plain", "chat", "mode", "cost_pct_vs_plain",
           cost, {"mode": "capture_last_prompt"}, goal=at_most(5, "≤ 5 %")),
    Figure("… at one layer", "chat", "mode", "cost_pct_vs_plain", cost, {"mode": "capture_last_prompt_one_layer"},
           goal=at_most(5, "≤ 5 %")),
    Figure("… every prompt row", "chat", "mode", "cost_pct_vs_plain", cost, {"mode": "capture_all_prompt"},
           goal=at_most(15, "≤ 15 %")),
    Figure("Gemma 2 2B shape, of the byte roofline", "throughput", "roofline", "fraction_of_roofline", pct,
           _throughput("gemma2-2b"), roofline_step, at_least(0.7, "≥ 70 %")),
    Figure("Neuronpedia steer calls (STEERED + DEFAULT), of `/v1/completions`", "neuronpedia", "ratio",
           "neuronpedia_over_completions", times, {"shape": "qwen3-0.6b"}, goal=at_least(0.9, "≥ 0.9×")),
    Figure("feature dashboards of every feature in one pass, of sparse capture's speed", "dashboards", "ratio",
           "dashboards_vs_sparse_capture", pct, {"d_sae": 65536}, dashboards_detail, at_least(0.7, "≥ 70 %")),
    Figure("CPU, SmolLM2 fp32, 64 prompts, of vLLM-CPU's speed", "cpu_duel", "ratio", "steerable_over_vllm", times,
           {"workload": "batch64"}, duel_detail, at_least(1.0, "≥ 1×")),
    Figure("… batch 1", "cpu_duel", "ratio", "steerable_over_vllm", times, {"workload": "batch1"}, duel_detail,
           at_least(1.0, "≥ 1×")),
))

THROUGHPUT = Table("throughput", (
    Figure("Qwen3-0.6B shape, bf16 KV", "throughput", "steerable", "output_tok_s", tok_s, BF16, runs_and_roofline),
    Figure("Qwen3-0.6B shape, fp8 KV", "throughput", "steerable", "output_tok_s", tok_s,
           {**DENSE, "kv_cache_dtype": "fp8"}, runs_and_roofline),
    Figure("Qwen3-8B shape", "throughput", "steerable", "output_tok_s", tok_s, _throughput("qwen3-8b"),
           runs_and_roofline),
    Figure("Qwen3-30B-A3B shape (MoE)", "throughput", "steerable", "output_tok_s", tok_s, _throughput("qwen3-30b-a3b"),
           runs_and_roofline),
    Figure("Gemma 2 2B shape", "throughput", "steerable", "output_tok_s", tok_s, _throughput("gemma2-2b"),
           runs_and_roofline),
    Figure("Gemma 3 270M shape", "throughput", "steerable", "output_tok_s", tok_s, _throughput("gemma3-270m"),
           runs_and_roofline),
    Figure("Gemma 3 4B shape", "throughput", "steerable", "output_tok_s", tok_s, _throughput("gemma3-4b"),
           runs_and_roofline),
    Figure("GPT-2 124M shape (lengths up to 512)", "throughput", "steerable", "output_tok_s", tok_s,
           _throughput("gpt2"), runs_and_roofline),
    Figure("Qwen3-0.6B shape, of HF `generate`", "throughput", "ratio", "output_tok_s_ratio", times,
           {"shape": "qwen3-0.6b"}),
    Figure("Qwen3-30B-A3B shape, CUDA graphs of eager", "throughput", "graphs_vs_eager", "speedup", times,
           {"shape": "qwen3-30b-a3b"}),
))

LATENCY = Table("latency", (
    Figure("Qwen3-0.6B shape", "latency", "latency", "decode_ms_per_token", ms_token,
           {"shape": "qwen3-0.6b", "mode": "unsteered"}, steered),
    Figure("Qwen3-30B-A3B shape", "latency", "latency", "decode_ms_per_token", ms_token,
           {"shape": "qwen3-30b-a3b", "mode": "unsteered"}, steered),
))


def _modes(bench: str, modes: dict[str, str], baseline: str = "none", detail=None) -> tuple[Figure, ...]:
    return tuple(Figure(what, bench, "run", "cost_pct", cost, {**STEERING, "mode": mode}, detail or against(baseline))
                 for mode, what in modes.items())


STEERING_COST = Table("steering_cost", _modes("steering_cost", {
    "global_all_layers": "one vector at every layer, every request",
    "per_request_distinct": "256 distinct per-request vectors at every layer",
    "global_clamp_all_layers": "a projection clamp at every layer",
    "mixed_distinct": "256 distinct mixed configs",
    "lowrank_distinct": "256 distinct per-request rank-4 LoReFTs (`LowRank`) at one layer",
    "when_token_all_layers": "one `When(scope=\"token\")` gating a vector at every layer",
}))

CAPTURE_COST = Table("capture_cost", _modes("capture_cost", {
    "stream_last_prompt": "last prompt row at every layer, a stream",
    "per_request_last_prompt": "the same, per-request `CaptureSpec`s",
}) + _modes("capture_cost", {"stream_all_generated": "every generated token at every layer, 64 requests"},
            detail=fetch))

SAE_COST = Table("sae_cost", _modes("sae_cost", {
    "capture_top_k_every_token": "top-32 features of every token (65,536-feature SAE)",
    "feature_steering_distinct": "256 distinct configs of feature adds and clamps",
    "transcoder_capture_top_k_every_token": "top-32 features of every token (16,384-feature transcoder at mlp_in)",
    "transcoder_steering_distinct": "256 distinct configs of transcoder feature adds and clamps",
}) + (Figure("sparse corpus capture, top 32 of every prompt row", "sae_cost", "run", "prompt_tok_s", tok_s,
             {**STEERING, "mode": "corpus_sparse"}),))

PATTERN_COST = Table("pattern_cost", _modes("pattern_cost", {
    "last_prompt_one_layer": "one layer, every head, last prompt token of every request",
    "all_layers_generated": "every layer, every generated token of 16 requests",
}))

SERVE = Table("serve", (
    Figure("256 requests at once, of offline output tok/s", "serve", "ratio", "output_tok_s_ratio", times,
           {"shape": "qwen3-0.6b", "max_concurrency": None, "request_rate": None}, serve_detail),
    Figure("concurrency 1, ITL p50 of offline ms/token", "serve", "ratio", "itl_p50_over_offline_ms_per_token",
           times, {"shape": "qwen3-0.6b", "max_concurrency": 1}, serve_c1_detail),
))

CAPTURE_CORPUS = Table("capture_corpus", (
    Figure("256 prompts, every layer and position, of HF", "capture_corpus", "ratio", "prompt_tok_s_ratio", times,
           {"shape": "qwen3-0.6b"}, corpus_detail),
))

SAELENS_CACHE = Table("saelens_cache", (
    Figure("one layer, windows of 128, of the engine's own prefill", "saelens_cache", "ratio", "of_prefill", pct,
           SAELENS, writer_detail),
    Figure("… over HF `output_hidden_states` at its best batch size", "saelens_cache", "ratio", "over_hf", times,
           SAELENS, writer_detail),
))

CORPUS_SHARDS = Table("corpus_shards", (
    Figure("a shard's overhead in one engine, of its capture time", "corpus_shards", "run", "overhead_fraction",
           pct_fine, {"mode": "many"}, shard_parts),
    Figure("… on two replicas", "corpus_shards", "replicas", "overhead_fraction", pct_fine, {"replicas": 2},
           shard_parts),
))

CORPUS_HOST = Table("corpus_host", (
    Figure("a shard delivered into its mapped file", "corpus_host", "shard", "seconds", seconds, {"mode": "mapped"},
           shard),
    Figure("delivered into memory, then `save_file`", "corpus_host", "shard", "seconds", seconds,
           {"mode": "memory_then_save_file"}, shard),
))

COLD_START = Table("cold_start", (
    Figure("first `generate` of 32 requests, over the second", "cold_start", "cold_start", "first_vs_second_pct", cost,
           {"shape": "qwen3-0.6b"}),
    Figure("`LLM(...)`", "cold_start", "cold_start", "llm_init_s", seconds, {"shape": "qwen3-0.6b"}),
))

PARALLEL = Table("parallel", tuple(
    Figure(what, "parallel", "summary", key, fmt, {"shape": "qwen3-8b"}) for key, what, fmt in (
        ("tp2_throughput_ratio", "TP=2 throughput, of TP=1", times),
        ("pp2_throughput_ratio", "PP=2 throughput, of TP=1", times),
        ("tp2_latency_ratio", "TP=2 batch-1 ms/token, of TP=1", times),
        ("tp2_steering_cost_pct", "a vector at every layer under TP=2", cost),
        ("tp2_capture_cost_pct", "last-prompt capture at every layer under TP=2", cost))))

CHAT_MODES = {
    "capture_last_prompt": "last prompt row at every layer, per request, below plain",
    "capture_last_prompt_one_layer": "the same at one layer",
    "capture_last_prompt_stream": "the same at every layer, a stream",
    "capture_all_prompt": "every prompt row at one layer (activation store), below plain",
    "capture_generated": "every generated row at one layer, below plain",
    "steer_decode": "a decode-only vector at every layer, below plain",
    "cache_off": "prefix caching off, below plain",
    "shared_prefix_off": "shared-prefix attention off, below plain",
}

CHAT_TABLE = Table("chat", (
    Figure("plain (prefix caching, shared-prefix attention)", "chat", "mode", "output_tok_s", tok_s,
           {**CHAT, "mode": "plain"}),
    *(Figure(what, "chat", "mode", "cost_pct_vs_plain", cost, {**CHAT, "mode": mode}, chat_mode_detail)
      for mode, what in CHAT_MODES.items()),
    Figure("plain over caching off", "chat", "ratio", "speedup_vs_cache_off", times, CHAT, chat_ratio_detail),
    Figure("plain over shared-prefix attention off", "chat", "ratio", "speedup_vs_cache_on", times, CHAT),
    Figure("before `chat`: shared-prefix attention over caching off (`shared_prefix`)", "shared_prefix", "ratio",
           "speedup_vs_cache_off", times, CHAT, chat_detail),
    Figure("… over caching on", "shared_prefix", "ratio", "speedup_vs_cache_on", times, CHAT),
))

KV_MEMORY = Table("kv_memory", (
    Figure("less KV while decoding, than every token of every layer", "kv_memory", "kv_memory", "decode_saving", times),
    Figure("less KV at the peak (a prefill chunk)", "kv_memory", "kv_memory", "peak_saving", times),
))

KV_FIDELITY = Table("kv_fidelity", (
    Figure("fp8 KV, teacher-forced top-1 agreement with the model-dtype cache", "kv_fidelity", "kv_fidelity",
           "top1_agreement", pct, detail=positions),
))

OUTPUT_CODEC = Table("output_codec", (
    Figure("engine side (build + pickle), whole over increments", "output_codec", "ratio", "engine_side", times),
    Figure("server side (unpickle, rebuild), whole over increments", "output_codec", "ratio", "server_side", times),
))

HOST_STEP_COST = Table("host_step_cost", (
    Figure("admitting 256 `mixed_distinct` requests", "host_step_cost", "run", "admit_ms", ms,
           {"mode": "mixed_distinct", "num_requests": 256}, admission),
))

TABLES = (TARGETS, THROUGHPUT, LATENCY, SERVE, STEERING_COST, CAPTURE_COST, SAE_COST, PATTERN_COST, CAPTURE_CORPUS,
          SAELENS_CACHE, CORPUS_SHARDS, CORPUS_HOST, COLD_START, PARALLEL, CHAT_TABLE, KV_MEMORY, KV_FIDELITY,
          OUTPUT_CODEC, HOST_STEP_COST)
