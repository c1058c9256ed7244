"""Every benchmark runs end to end through the runner (``python -m benchmarks NAME --smoke``: tiny
random models, CPU, seconds) and prints the JSON records the GPU runs are read from; the numbers
themselves are only checked for sanity. The planes' benchmarks (corpus capture, chat, activation
streams, dashboards, Neuronpedia) are in test_benchmarks_planes.py."""

from __future__ import annotations

import json

import pytest
from bench_harness import positive, run

pytestmark = pytest.mark.slow


def test_throughput_with_hf_baseline(bench_cache_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    r = run("throughput", bench_cache_dir, "--hf-requests", "4", "--hf-batch-size", "2", "--out", str(out))
    ours, hf, ratio = r["steerable"][0], r["hf"][0], r["ratio"][0]
    positive(ours, "seconds", "output_tok_s", "total_tok_s", "output_tokens", "input_tokens")
    positive(hf, "seconds", "output_tok_s", "total_tok_s", "output_tokens")
    positive(ratio, "output_tok_s_ratio", "total_tok_s_ratio")
    assert ours["requests"] == 6 and hf["requests"] == 4 and hf["batch_size"] == 2
    assert ours["output_tokens"] > hf["output_tokens"]  # HF counted on its first 4 requests only
    assert r["engine_stats"][0]["num_steps"] > 0
    roof = r["roofline"][0]
    positive(roof, "weight_bytes_per_step", "kv_bytes_per_step", "copy_gb_s", "roofline_step_ms", "measured_step_ms",
             "steps")
    assert roof["bytes_per_step"] == roof["weight_bytes_per_step"] + roof["kv_bytes_per_step"]
    assert len(out.read_text().splitlines()) == sum(len(v) for v in r.values())


def test_throughput_moe_graphs_vs_eager(bench_cache_dir):
    """The Qwen3-30B-A3B shape (tiny in --smoke, weights drawn by the engine): graphs and eager runs
    and the HF baseline from the same config."""
    r = run("throughput", bench_cache_dir, "--shape", "qwen3-30b-a3b", "--compare-eager", "--hf-requests", "2",
            "--hf-batch-size", "2")
    runs = {x["enforce_eager"]: x for x in r["steerable"]}
    assert set(runs) == {False, True} and len(r["llm_init"]) == 2
    for x in runs.values():
        positive(x, "seconds", "output_tok_s")
        assert x["graph_replays_timed"] == 0  # CPU: no CUDA graphs
    positive(r["graphs_vs_eager"][0], "speedup")
    positive(r["hf"][0], "seconds", "output_tok_s")
    assert r["header"][0]["args"]["load_format"] == "dummy"


def test_sae_cost(bench_cache_dir):
    r = run("sae_cost", bench_cache_dir, "--repeats", "2")
    runs = {x["mode"]: x for x in r["run"]}
    corpus = runs.pop("corpus_sparse")
    assert list(runs) == ["none", "capture_top_k_every_token", "feature_steering_distinct",
                          "transcoder_capture_top_k_every_token", "transcoder_steering_distinct"]
    for x in runs.values():
        positive(x, "seconds", "output_tok_s", "total_tok_s")
        assert len(x["seconds_all"]) == 2 and isinstance(x["cost_pct"], float)
    positive(corpus, "prompt_tok_s")
    assert corpus["rows"] == corpus["prompt_tokens"] and len(corpus["seconds_all"]) == 2
    assert r["sae"][0]["d_sae"] == 256 and r["steering_status"][0]["ok"]
    assert r["transcoder"][0]["d_transcoder"] == 128 and r["transcoder"][0]["hook"] == "mlp_in"
    subset = run("sae_cost", bench_cache_dir, "--modes", "none,transcoder_capture_top_k_every_token", "--no-corpus")
    assert [x["mode"] for x in subset["run"]] == ["none", "transcoder_capture_top_k_every_token"]


def test_pattern_cost(bench_cache_dir):
    r = run("pattern_cost", bench_cache_dir, "--repeats", "2")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "last_prompt_one_layer", "all_layers_generated"]
    for x in runs.values():
        positive(x, "seconds", "output_tok_s")
        assert len(x["seconds_all"]) == 2 and isinstance(x["cost_pct"], float)
    assert runs["none"]["pattern_rows"] == 0 and runs["last_prompt_one_layer"]["pattern_rows"] == runs["none"]["requests"]
    assert runs["all_layers_generated"]["pattern_rows"] > 0


def test_steering_cost(bench_cache_dir):
    r = run("steering_cost", bench_cache_dir, "--repeats", "2", "--breakdown")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "global_all_layers", "per_request_distinct", "global_clamp_all_layers",
                          "mixed_distinct", "lowrank_distinct", "when_token_all_layers"]
    for x in runs.values():
        positive(x, "seconds", "output_tok_s", "total_tok_s")
        assert len(x["seconds_all"]) == 2 and isinstance(x["cost_pct"], float)
        # every request checked (up front), admitted (inside the steps: generate queues them), every step timed
        parts = x["breakdown"]
        assert parts["check_s"] > 0 and parts["admit_s"] > 0 and parts["decode_steps"] > 0 and parts["other_steps"] > 0
        assert parts["admit_s"] < parts["decode_s"] + parts["other_s"] <= max(x["seconds_all"])
        assert parts["check_s"] + parts["decode_s"] + parts["other_s"] <= max(x["seconds_all"])
    assert runs["none"]["cost_pct"] == 0.0
    status = r["steering_status"][0]
    assert status["ok"] and status["rows_in_use"] == 0
    # the first warm-up pass lays out the steering tables (graphs warmed before mixed_distinct widened
    # them would be stale); the second leaves them as they are
    (warmup,) = r["warmup"]
    assert warmup["passes"] == 2 and warmup["steering_table_version"] > 0


def test_host_step_cost(bench_cache_dir):
    r = run("host_step_cost", bench_cache_dir, "--repeats", "1", "--modes", "global_all_layers,mixed_distinct",
            model=False)
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "global_all_layers", "mixed_distinct"] and runs["none"]["extra_host_ms"] == 0
    for x in runs.values():
        positive(x, "admit_ms", "steps", "step_host_ms", "decode_host_ms", "total_host_ms")
        assert x["total_host_ms"] == pytest.approx(x["admit_ms"] + x["steps"] * x["step_host_ms"])


def test_capture_cost(bench_cache_dir):
    r = run("capture_cost", bench_cache_dir, "--repeats", "2")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "stream_last_prompt", "per_request_last_prompt", "none_bulk", "stream_all_generated"]
    for x in runs.values():
        positive(x, "seconds", "output_tok_s", "total_tok_s")
        assert len(x["seconds_all"]) == 2
    assert runs["stream_last_prompt"]["rows_ok"] and runs["per_request_last_prompt"]["rows_ok"]
    assert runs["stream_last_prompt"]["tokens_dropped"] == 0
    bulk = runs["stream_all_generated"]
    assert bulk["rows_ok"] and bulk["baseline"] == "none_bulk" and bulk["requests"] == 4
    positive(bulk, "fetch_s", "fetch_gb_s", "fetch_bytes")
    assert bulk["rows_per_layer"] == runs["none_bulk"]["output_tokens"] - 4  # every generated input row
    assert runs["none_bulk"]["cost_pct"] == 0.0 and runs["none"]["cost_pct"] == 0.0
    assert "graph_replays" in r["capture_status"][0]


def test_capture_cost_runs_a_subset_with_its_baseline(bench_cache_dir):
    r = run("capture_cost", bench_cache_dir, "--modes", "stream_all_generated")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none_bulk", "stream_all_generated"]  # the baseline runs without being asked for
    assert runs["stream_all_generated"]["rows_ok"] and runs["stream_all_generated"]["baseline"] == "none_bulk"


def test_latency(bench_cache_dir):
    r = run("latency", bench_cache_dir, "--repeats", "2")
    modes = {x["mode"]: x for x in r["latency"]}
    assert set(modes) == {"unsteered", "steered"}
    for x in modes.values():
        positive(x, "decode_ms_per_token", "full_s", "first_token_s")
        assert len(x["decode_ms_per_token_all"]) == 2


def test_serve(bench_cache_dir):
    """Concurrency 1 with Poisson arrivals: the load generator, both baselines and the ratios."""
    r = run("serve", bench_cache_dir, "--max-concurrency", "1", "--request-rate", "50")
    offline, serve, ratio = r["offline"][0], r["serve"][0], r["ratio"][0]
    positive(offline, "seconds", "output_tok_s", "decode_ms_per_token")
    positive(serve, "seconds", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    assert serve["requests"] == 6 and serve["failed"] == 0 and serve["output_tokens"] == offline["output_tokens"]
    positive(ratio, "output_tok_s_ratio", "itl_p50_over_offline_ms_per_token")


def test_serve_with_client_processes(bench_cache_dir):
    """At saturation, the load spread over two client processes: every request answered once, in full."""
    r = run("serve", bench_cache_dir, "--client-processes", "2")
    offline, serve = r["offline"][0], r["serve"][0]
    positive(serve, "seconds", "output_tok_s", "ttft_ms_p50", "chunks", "client_cpu_s")
    assert serve["client_processes"] == 2 and serve["failed"] == 0
    assert serve["requests"] == offline["requests"] and serve["output_tokens"] == offline["output_tokens"]


def test_gemma_shape_throughput_and_kv_memory(bench_cache_dir):
    """The throughput workload on a Gemma 3 shape, and the KV-memory record of one long request
    (chunks of 32 against a window of 8: the sliding groups must hold less than every layer)."""
    r = run("throughput", bench_cache_dir, "--shape", "gemma3-270m", "--skip-hf")
    assert r["header"][0]["args"]["shape"] == "gemma3-270m"
    positive(r["steerable"][0], "seconds", "output_tok_s")
    m = run("kv_memory", bench_cache_dir, "--max-num-batched-tokens", "32")["kv_memory"][0]
    assert m["groups"] == 6 and m["windows"] == [8]
    assert m["peak_blocks"] <= m["bound_blocks"] and m["decode_saving"] > m["peak_saving"] > 1.5


def test_gemma2_shape_throughput_and_roofline(bench_cache_dir):
    """The Gemma 2 shape (soft-caps, alternating windows) runs the throughput workload; its
    roofline counts the sliding layers' KV reads only within their window."""
    r = run("throughput", bench_cache_dir, "--shape", "gemma2-2b", "--skip-hf")
    assert r["header"][0]["args"]["shape"] == "gemma2-2b"
    positive(r["steerable"][0], "seconds", "output_tok_s")
    positive(r["roofline"][0], "bytes_per_step", "roofline_step_ms", "measured_step_ms")


def test_kv_bytes_read_respects_windows():
    from types import SimpleNamespace

    import torch

    from benchmarks import common

    windows = [4, None]
    cfg = SimpleNamespace(num_kv_heads=2, head_dim=8, num_layers=2, attention_window=lambda layer: windows[layer])
    w = common.Workload([[0] * 3], [3], [4])  # decode steps read 4, 5, 6 positions
    per_position = 2 * 2 * 8 * 2
    assert common.kv_bytes_read(cfg, torch.bfloat16, w) == per_position * ((4 + 4 + 4) + (4 + 5 + 6))


def test_gpt2_shape_throughput(bench_cache_dir):
    """The GPT-2 shape builds, runs, and its full-size workload fits its 1024 positions."""
    r = run("throughput", bench_cache_dir, "--shape", "gpt2", "--hf-requests", "2")
    positive(r["steerable"][0], "seconds", "output_tok_s")
    from benchmarks import common

    assert common.SHAPE_MAX_LEN["gpt2"] * 2 <= common.GPT2_124M["n_positions"]


def test_parallel(bench_cache_dir, monkeypatch):
    """TP=1, TP=2 and PP=2 on CPU (gloo): every record and the summary's ratios are there."""
    monkeypatch.setenv("STEERABLE_WORKER_START_METHOD", "forkserver")  # ranks start without re-importing torch
    r = run("parallel", bench_cache_dir, "--repeats", "1", "--latency-repeats", "1")
    layouts = {x["layout"]: x for x in r["throughput"]}
    assert list(layouts) == ["tp1", "tp2", "pp2"]
    for x in layouts.values():
        positive(x, "seconds", "output_tok_s", "total_tok_s", "output_tokens")
    positive(layouts["tp2"], "decode_ms_per_token")
    assert {"steered_cost_pct", "captured_cost_pct"} <= set(layouts["tp2"])
    assert [x["tensor_parallel_size"] for x in r["llm_init"]] == [1, 2, 1]
    mixed = r["mixed_capture"][0]
    assert mixed["rows_ok"] and mixed["plain_ok"]
    summary = r["summary"][0]
    for key in ("tp2_throughput_ratio", "pp2_throughput_ratio", "tp2_latency_ratio", "tp2_steering_cost_pct",
                "tp2_capture_cost_pct"):
        assert isinstance(summary[key], float) and isinstance(summary[f"{key}_met"], bool)


def test_cold_start(bench_cache_dir):
    r = run("cold_start", bench_cache_dir, "--repeats", "1")
    assert len(r["cold_start_run"]) == 1
    summary = r["cold_start"][0]
    positive(summary, "llm_init_s", "first_s", "second_s")
    assert summary["repeats"] == 1 and summary["requests"] == 4
    assert summary["graph_captures_in_first"] == 0  # CPU: no graphs; on a GPU, all captured in LLM(...)


def test_kv_fidelity(bench_cache_dir):
    r = run("kv_fidelity", bench_cache_dir)
    summary = r["kv_fidelity"][0]
    assert summary["prompts"] == 2 and summary["positions"] == 2 * 24 and len(r["prompt"]) == 2
    assert 0.0 <= summary["top1_agreement"] <= 1.0
    bytes_ = summary["kv_cache_bytes"]
    assert bytes_["fp8"] * 4 == bytes_["auto"]  # float32 on the CPU


def test_output_codec(bench_cache_dir):
    """The engine pipe's per-step cost, whole outputs against increments (the script itself checks
    that the rebuilt outputs equal the engine's)."""
    r = run("output_codec", bench_cache_dir, model=False)
    steps = r["step"]
    assert {s["mode"] for s in steps} == {"whole", "increments"}
    assert sorted(f["taken_every"] for f in r["fold"]) == [1, 2, 3]
    for f in r["fold"]:
        positive(f, "server_ms_per_step")
    for s in steps:
        positive(s, "engine_ms", "server_ms", "bytes")
    last = {s["mode"]: s for s in steps if s["tokens"] == max(t["tokens"] for t in steps)}
    assert last["increments"]["bytes"] < last["whole"]["bytes"]  # only what is new crosses the pipe
    positive(r["ratio"][0], "engine_side", "server_side")


def _interpreter_in_a_subprocess() -> None:
    """The interpreter runs only where no GPU is: on a CUDA machine Triton 3.6's interpreter, set
    for a subprocess, fails inside the kernels' helper calls ("Did you forget to add
    @triton.jit?"), and the GPU runs the compiled kernels that the GPU tests check."""
    pytest.importorskip("triton")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the compiled kernels, not the interpreter (see the docstring)")


@pytest.mark.triton
def test_attention_replay_under_the_interpreter(bench_cache_dir):
    _interpreter_in_a_subprocess()
    r = run("attention_replay", bench_cache_dir, model=False, env={"TRITON_INTERPRET": "1", "STEERABLE_FUSED_ON_CPU": "1"})
    configs = r["config"]
    assert {(c["config"], c["kv_dtype"]) for c in configs} == {
        (name, dtype) for name in ("shipped", "unified_tile_16", "split_target_8")
        for dtype in ("float32", "float8_e4m3fn")}
    for c in configs:  # the split-KV paths (shipped, a program target) and the unified kernel agree on every step
        positive(c, "seconds", "vs_shipped", "bound_seconds", "fraction_of_bound")
        assert c["max_abs_diff_vs_shipped"] < 1e-5
        assert sum(c["by_batch"].values()) == pytest.approx(c["seconds"])
        if c["config"] == "shipped":
            assert c["vs_shipped"] == 1.0


@pytest.mark.triton
def test_gemma2_decode_under_the_interpreter(bench_cache_dir, tmp_path):
    """The probe's kernel parts: every attention candidate replayed and exact, the logits chain per
    soft-cap mode weighted by the workload's decode steps, and the winners' environment written out."""
    _interpreter_in_a_subprocess()
    env_file = tmp_path / "knobs.env"
    r = run("gemma2_decode", bench_cache_dir, "--parts", "attention,logits", "--env-file", str(env_file), model=False,
            env={"TRITON_INTERPRET": "1", "STEERABLE_FUSED_ON_CPU": "1"})
    assert [c["config"] for c in r["config"]] == ["shipped", "tile_16", "split_all_8"]
    for c in r["config"]:
        positive(c, "seconds", "bound_seconds", "fraction_of_bound")
        assert c["max_abs_diff_vs_shipped"] < 1e-4
    logits = r["logits"][0]
    assert logits["decode_steps"] == sum(at["steps"] for at in r["logits_at"])
    for key in ("cublas:head", "cublas:torch", "cublas:kernel", "cublas:sampler", "cublas:layers",
                "post_norm:separate", "post_norm:fused"):
        positive(logits["seconds"], key)
    choice = r["choice"][0]["env"]
    assert choice["STEERABLE_FINAL_SOFTCAP"] in ("torch", "kernel", "sampler")
    assert choice["STEERABLE_FUSE_POST_NORM"] in ("0", "1")
    assert env_file.read_text() == "".join(f"{k}={v}\n" for k, v in choice.items())


def test_gemma2_decode_throughput_runs(bench_cache_dir, tmp_path):
    """Its throughput part: today's defaults and a candidate environment, each throughput.py in a
    subprocess whose records go beside the probe's, under a header naming the variables it ran with."""
    env = {"STEERABLE_FINAL_SOFTCAP": "kernel", "STEERABLE_ATTENTION_CONFIG_WIDE": "decode_tile_n=32"}
    r = run("gemma2_decode", bench_cache_dir, "--parts", "throughput", "--throughput-shapes", "gemma2-2b", "--repeats", "1",
            "--env", json.dumps(env), "--out", str(tmp_path), model=False)
    runs = r["throughput"]
    assert [(t["run"], t["env"]) for t in runs] == [("defaults", {}), ("candidate", env)]
    for t in runs:
        positive(t, "output_tok_s", "fraction_of_roofline", "measured_step_ms")
    (records,) = tmp_path.glob("*-throughput.jsonl")
    headers = [json.loads(line) for line in records.read_text().splitlines() if '"record": "header"' in line]
    assert [h["env"] for h in headers] == [{}, env]


@pytest.mark.triton
def test_moe_tune_under_the_interpreter(bench_cache_dir):
    _interpreter_in_a_subprocess()
    r = run("moe_tune", bench_cache_dir, model=False, env={"TRITON_INTERPRET": "1", "STEERABLE_FUSED_ON_CPU": "1"})
    assert [t["tokens"] for t in r["tuned"]] == [1, 5]
    for t in r["tuned"]:
        positive(t, "ms", "ms_default", "speedup_vs_default")
        assert t["block_m"] == 16 and set(t["gate_up"]) == {"block_n", "block_k", "group_m", "num_warps", "num_stages"}
    assert set(r["table"][0]["entries"]) == {"1", "5"}


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_profile_kernels(bench_cache_dir, phase):
    r = run("profile_kernels", bench_cache_dir, "--phase", phase)
    (profile,) = r["profile"]
    assert profile["phase"] == phase and profile["divided_by"] == (3 if phase == "decode" else 1)
    positive(profile, "wall_s")


def test_profile_kernels_decode_steering_modes(bench_cache_dir):
    """Decode steps profiled per steering mode, in one process."""
    r = run("profile_kernels", bench_cache_dir, "--phase", "decode", "--steering", "none,mixed_distinct")
    assert [p["phase"] for p in r["profile"]] == ["decode", "decode_mixed_distinct"]
    for profile in r["profile"]:
        positive(profile, "wall_s")


def test_profile_kernels_workload_modes_and_chat(bench_cache_dir):
    """Several steering modes profiled in one process, each with its engine counts; the chat phase
    profiles caching alone, then shared-prefix attention, on the same chats."""
    r = run("profile_kernels", bench_cache_dir, "--phase", "workload", "--steering", "none,mixed_distinct")
    assert [p["phase"] for p in r["profile"]] == ["workload_none", "workload_mixed_distinct"]
    assert [e["steering"] for e in r["engine"]] == ["none", "mixed_distinct"]
    for engine in r["engine"]:
        positive(engine, "num_steps")
    chat = run("profile_kernels", bench_cache_dir, "--phase", "chat", "--max-num-batched-tokens", "64")
    assert [p["phase"] for p in chat["profile"]] == ["chat_cache_on", "chat_shared"]
    on, shared = chat["engine"]
    assert on["num_steps"] == shared["num_steps"] > 0 and on["prefix_cache_hit_tokens"] > 0
