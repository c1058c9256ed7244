"""Every benchmark runs end to end through the runner (``python -m benchmarks NAME --smoke``: tiny
random models, CPU, seconds) and prints the JSON records the GPU runs are read from; the numbers
themselves are only checked for sanity."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("bench-cache"))


def run(script: str, cache_dir: str, *args: str, model: bool = True, env: dict | None = None) -> dict[str, list[dict]]:
    """``python -m benchmarks <script> --smoke``; stdout must be JSON lines only. Records by type."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "benchmarks", script, "--smoke", "--cache-dir", cache_dir, *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        assert record["bench"] == script
        records.setdefault(record["record"], []).append(record)
    header = records["header"][0]
    assert header["smoke"] is True and header["torch"] and header["command"].startswith(f"python -m benchmarks {script}")
    if model:
        assert header["model"] and records["llm_init"][0]["seconds"] > 0
    return records


def positive(record: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(record[key], (int, float)) and record[key] > 0, (key, record)


def test_throughput_with_hf_baseline(cache_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    r = run("throughput", cache_dir, "--hf-requests", "4", "--hf-batch-size", "2", "--out", str(out))
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


def test_throughput_moe_graphs_vs_eager(cache_dir):
    """The Qwen3-30B-A3B shape (tiny in --smoke, weights drawn by the engine): graphs and eager runs
    and the HF baseline from the same config."""
    r = run("throughput", cache_dir, "--shape", "qwen3-30b-a3b", "--compare-eager", "--hf-requests", "2",
            "--hf-batch-size", "2")
    runs = {x["enforce_eager"]: x for x in r["steerable"]}
    assert set(runs) == {False, True} and len(r["llm_init"]) == 2
    for x in runs.values():
        positive(x, "seconds", "output_tok_s")
        assert x["graph_replays_timed"] == 0  # CPU: no CUDA graphs
    positive(r["graphs_vs_eager"][0], "speedup")
    positive(r["hf"][0], "seconds", "output_tok_s")
    assert r["header"][0]["args"]["load_format"] == "dummy"


def test_sae_cost(cache_dir):
    r = run("sae_cost", cache_dir, "--repeats", "2")
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
    subset = run("sae_cost", cache_dir, "--modes", "none,transcoder_capture_top_k_every_token", "--no-corpus")
    assert [x["mode"] for x in subset["run"]] == ["none", "transcoder_capture_top_k_every_token"]


def test_pattern_cost(cache_dir):
    r = run("pattern_cost", cache_dir, "--repeats", "2")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "last_prompt_one_layer", "all_layers_generated"]
    for x in runs.values():
        positive(x, "seconds", "output_tok_s")
        assert len(x["seconds_all"]) == 2 and isinstance(x["cost_pct"], float)
    assert runs["none"]["pattern_rows"] == 0 and runs["last_prompt_one_layer"]["pattern_rows"] == runs["none"]["requests"]
    assert runs["all_layers_generated"]["pattern_rows"] > 0


def test_steering_cost(cache_dir):
    r = run("steering_cost", cache_dir, "--repeats", "2", "--breakdown")
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


def test_host_step_cost(cache_dir):
    r = run("host_step_cost", cache_dir, "--repeats", "1", "--modes", "global_all_layers,mixed_distinct",
            model=False)
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none", "global_all_layers", "mixed_distinct"] and runs["none"]["extra_host_ms"] == 0
    for x in runs.values():
        positive(x, "admit_ms", "steps", "step_host_ms", "decode_host_ms", "total_host_ms")
        assert x["total_host_ms"] == pytest.approx(x["admit_ms"] + x["steps"] * x["step_host_ms"])


def test_capture_cost(cache_dir):
    r = run("capture_cost", cache_dir, "--repeats", "2")
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


def test_capture_cost_runs_a_subset_with_its_baseline(cache_dir):
    r = run("capture_cost", cache_dir, "--modes", "stream_all_generated")
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["none_bulk", "stream_all_generated"]  # the baseline runs without being asked for
    assert runs["stream_all_generated"]["rows_ok"] and runs["stream_all_generated"]["baseline"] == "none_bulk"


def test_latency(cache_dir):
    r = run("latency", cache_dir, "--repeats", "2")
    modes = {x["mode"]: x for x in r["latency"]}
    assert set(modes) == {"unsteered", "steered"}
    for x in modes.values():
        positive(x, "decode_ms_per_token", "full_s", "first_token_s")
        assert len(x["decode_ms_per_token_all"]) == 2


def test_serve(cache_dir):
    """Concurrency 1 with Poisson arrivals: the load generator, both baselines and the ratios."""
    r = run("serve", cache_dir, "--max-concurrency", "1", "--request-rate", "50")
    offline, serve, ratio = r["offline"][0], r["serve"][0], r["ratio"][0]
    positive(offline, "seconds", "output_tok_s", "decode_ms_per_token")
    positive(serve, "seconds", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    assert serve["requests"] == 6 and serve["failed"] == 0 and serve["output_tokens"] == offline["output_tokens"]
    positive(ratio, "output_tok_s_ratio", "itl_p50_over_offline_ms_per_token")


def test_serve_with_client_processes(cache_dir):
    """At saturation, the load spread over two client processes: every request answered once, in full."""
    r = run("serve", cache_dir, "--client-processes", "2")
    offline, serve = r["offline"][0], r["serve"][0]
    positive(serve, "seconds", "output_tok_s", "ttft_ms_p50", "chunks", "client_cpu_s")
    assert serve["client_processes"] == 2 and serve["failed"] == 0
    assert serve["requests"] == offline["requests"] and serve["output_tokens"] == offline["output_tokens"]


def test_capture_corpus_with_hf_baseline(cache_dir):
    r = run("capture_corpus", cache_dir, "--repeats", "2")
    runs = {}
    for x in r["run"]:
        runs.setdefault(x["mode"], []).append(x)
    assert list(runs) == ["steerable", "hf"] and [x["repeat"] for x in runs["hf"]] == [0, 1]
    for x in runs["steerable"] + runs["hf"]:
        positive(x, "seconds", "prompt_tok_s", "prompt_tokens", "gb_written")
    assert runs["steerable"][0]["rows"] == runs["hf"][0]["rows"] == runs["steerable"][0]["prompt_tokens"]
    check = r["check"][0]
    assert check["rows_ok"] and check["values_checked"] and check["max_abs_diff"] < 1e-5
    ratio = r["ratio"][0]
    positive(ratio, "prompt_tok_s_ratio")
    assert ratio["repeats"] == 2 and ratio["hf_median_s"] == min(x["seconds"] for x in runs["hf"])


def test_saelens_cache_with_prefill_and_hf_baselines(cache_dir):
    """The SAELens writer against the engine's own prefill and HF at each batch size; the script
    itself checks the kept dataset's rows and token ids."""
    r = run("saelens_cache", cache_dir, "--repeats", "2")
    assert [x["repeat"] for x in r["prefill"]] == [x["repeat"] for x in r["saelens"]] == [0, 1]
    for x in r["prefill"] + r["saelens"]:
        positive(x, "seconds", "tok_s", "tokens")
    assert r["saelens"][0]["tokens"] == r["prefill"][0]["tokens"] == 12 * 16 and r["saelens"][0]["gb_written"] > 0
    assert [x["batch_size"] for x in r["hf"]] == [2, 4]
    assert r["check"][0]["token_ids_ok"] and r["check"][0]["rows"] == 12 and r["check"][0]["has_state"]
    ratio = r["ratio"][0]
    positive(ratio, "of_prefill", "over_hf")
    assert ratio["hf_best_tok_s"] == max(x["tok_s"] for x in r["hf"])


def test_corpus_shards_overhead(cache_dir):
    """Per-shard overhead in one engine and on two replicas, each part reported."""
    r = run("corpus_shards", cache_dir)
    assert [x["shards"] for x in r["run"]] == [1, 4]
    for x in r["run"] + r["replicas"]:
        positive(x, "capture_ms_per_shard", "overhead_fraction")
        assert {"scheduling_ms_per_shard", "write_ms_per_shard", "commit_ms_per_shard"} <= set(x)
    assert r["replicas"][0]["stats"]["replicas"] == 2 and r["replicas"][0]["shards"] == 4
    assert r["wall"][0]["shards"] == [1, 4]


def test_corpus_host(cache_dir):
    """Corpus capture's host side without a model (the script itself checks that the mapped shard
    holds save_file's tensors)."""
    r = run("corpus_host", cache_dir, model=False)
    for x in r["shard"]:
        positive(x, "gb", "seconds", "gb_s", "deliver_seconds")
    assert {x["mode"] for x in r["shard"]} == {"mapped", "memory_then_save_file"}
    assert [(x["mode"], x.get("threads")) for x in r["file"]][:2] == [("pwrite", 1), ("pwrite", 8)]
    for x in r["file"]:
        positive(x, "gb", "seconds", "gb_s")


def test_gemma_shape_throughput_and_kv_memory(cache_dir):
    """The throughput workload on a Gemma 3 shape, and the KV-memory record of one long request
    (chunks of 32 against a window of 8: the sliding groups must hold less than every layer)."""
    r = run("throughput", cache_dir, "--shape", "gemma3-270m", "--skip-hf")
    assert r["header"][0]["args"]["shape"] == "gemma3-270m"
    positive(r["steerable"][0], "seconds", "output_tok_s")
    m = run("kv_memory", cache_dir, "--max-num-batched-tokens", "32")["kv_memory"][0]
    assert m["groups"] == 6 and m["windows"] == [8]
    assert m["peak_blocks"] <= m["bound_blocks"] and m["decode_saving"] > m["peak_saving"] > 1.5


def test_gemma2_shape_throughput_and_roofline(cache_dir):
    """The Gemma 2 shape (soft-caps, alternating windows) runs the throughput workload; its
    roofline counts the sliding layers' KV reads only within their window."""
    r = run("throughput", cache_dir, "--shape", "gemma2-2b", "--skip-hf")
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


def test_gpt2_shape_throughput(cache_dir):
    """The GPT-2 shape builds, runs, and its full-size workload fits its 1024 positions."""
    r = run("throughput", cache_dir, "--shape", "gpt2", "--hf-requests", "2")
    positive(r["steerable"][0], "seconds", "output_tok_s")
    from benchmarks import common

    assert common.SHAPE_MAX_LEN["gpt2"] * 2 <= common.GPT2_124M["n_positions"]


def test_parallel(cache_dir, monkeypatch):
    """TP=1, TP=2 and PP=2 on CPU (gloo): every record and the summary's ratios are there."""
    monkeypatch.setenv("STEERABLE_WORKER_START_METHOD", "forkserver")  # ranks start without re-importing torch
    r = run("parallel", cache_dir, "--repeats", "1", "--latency-repeats", "1")
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


def test_cold_start(cache_dir):
    r = run("cold_start", cache_dir, "--repeats", "1")
    assert len(r["cold_start_run"]) == 1
    summary = r["cold_start"][0]
    positive(summary, "llm_init_s", "first_s", "second_s")
    assert summary["repeats"] == 1 and summary["requests"] == 4
    assert summary["graph_captures_in_first"] == 0  # CPU: no graphs; on a GPU, all captured in LLM(...)


def test_kv_fidelity(cache_dir):
    r = run("kv_fidelity", cache_dir)
    summary = r["kv_fidelity"][0]
    assert summary["prompts"] == 2 and summary["positions"] == 2 * 24 and len(r["prompt"]) == 2
    assert 0.0 <= summary["top1_agreement"] <= 1.0
    bytes_ = summary["kv_cache_bytes"]
    assert bytes_["fp8"] * 4 == bytes_["auto"]  # float32 on the CPU


def test_output_codec(cache_dir):
    """The engine pipe's per-step cost, whole outputs against increments (the script itself checks
    that the rebuilt outputs equal the engine's)."""
    r = run("output_codec", cache_dir, model=False)
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
def test_attention_replay_under_the_interpreter(cache_dir):
    _interpreter_in_a_subprocess()
    r = run("attention_replay", cache_dir, model=False, env={"TRITON_INTERPRET": "1", "STEERABLE_FUSED_ON_CPU": "1"})
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
def test_gemma2_decode_under_the_interpreter(cache_dir, tmp_path):
    """The probe's kernel parts: every attention candidate replayed and exact, the logits chain per
    soft-cap mode weighted by the workload's decode steps, and the winners' environment written out."""
    _interpreter_in_a_subprocess()
    env_file = tmp_path / "knobs.env"
    r = run("gemma2_decode", cache_dir, "--parts", "attention,logits", "--env-file", str(env_file), model=False,
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
    assert choice.get("STEERABLE_FINAL_SOFTCAP", "kernel") in ("kernel", "sampler")
    assert env_file.read_text() == "".join(f"{k}={v}\n" for k, v in choice.items())


def test_gemma2_decode_throughput_runs(cache_dir, tmp_path):
    """Its throughput part: today's defaults and a candidate environment, each throughput.py in a
    subprocess whose records go beside the probe's, under a header naming the variables it ran with."""
    env = {"STEERABLE_FINAL_SOFTCAP": "kernel", "STEERABLE_ATTENTION_CONFIG_WIDE": "decode_tile_n=32"}
    r = run("gemma2_decode", cache_dir, "--parts", "throughput", "--throughput-shapes", "gemma2-2b", "--repeats", "1",
            "--env", json.dumps(env), "--out", str(tmp_path), model=False)
    runs = r["throughput"]
    assert [(t["run"], t["env"]) for t in runs] == [("defaults", {}), ("candidate", env)]
    for t in runs:
        positive(t, "output_tok_s", "fraction_of_roofline", "measured_step_ms")
    (records,) = tmp_path.glob("*-throughput.jsonl")
    headers = [json.loads(line) for line in records.read_text().splitlines() if '"record": "header"' in line]
    assert [h["env"] for h in headers] == [{}, env]


@pytest.mark.triton
def test_moe_tune_under_the_interpreter(cache_dir):
    _interpreter_in_a_subprocess()
    r = run("moe_tune", cache_dir, model=False, env={"TRITON_INTERPRET": "1", "STEERABLE_FUSED_ON_CPU": "1"})
    assert [t["tokens"] for t in r["tuned"]] == [1, 5]
    for t in r["tuned"]:
        positive(t, "ms", "ms_default", "speedup_vs_default")
        assert t["block_m"] == 16 and set(t["gate_up"]) == {"block_n", "block_k", "group_m", "num_warps", "num_stages"}
    assert set(r["table"][0]["entries"]) == {"1", "5"}


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_profile_kernels(cache_dir, phase):
    r = run("profile_kernels", cache_dir, "--phase", phase)
    (profile,) = r["profile"]
    assert profile["phase"] == phase and profile["divided_by"] == (3 if phase == "decode" else 1)
    positive(profile, "wall_s")


def test_profile_kernels_decode_steering_modes(cache_dir):
    """Decode steps profiled per steering mode, in one process."""
    r = run("profile_kernels", cache_dir, "--phase", "decode", "--steering", "none,mixed_distinct")
    assert [p["phase"] for p in r["profile"]] == ["decode", "decode_mixed_distinct"]
    for profile in r["profile"]:
        positive(profile, "wall_s")


def test_profile_kernels_workload_modes_and_chat(cache_dir):
    """Several steering modes profiled in one process, each with its engine counts; the chat phase
    profiles caching alone, then shared-prefix attention, on the same chats."""
    r = run("profile_kernels", cache_dir, "--phase", "workload", "--steering", "none,mixed_distinct")
    assert [p["phase"] for p in r["profile"]] == ["workload_none", "workload_mixed_distinct"]
    assert [e["steering"] for e in r["engine"]] == ["none", "mixed_distinct"]
    for engine in r["engine"]:
        positive(engine, "num_steps")
    chat = run("profile_kernels", cache_dir, "--phase", "chat", "--max-num-batched-tokens", "64")
    assert [p["phase"] for p in chat["profile"]] == ["chat_cache_on", "chat_shared"]
    on, shared = chat["engine"]
    assert on["num_steps"] == shared["num_steps"] > 0 and on["prefix_cache_hit_tokens"] > 0


def test_chat(cache_dir):
    """Every mode on one engine; a small token budget admits chats over several steps, so the later
    ones hit the system prompt in the prefix cache (CPU: the torch backend has no shared kernel),
    and the all-prompt capture takes those blocks' rows from the activation store."""
    r = run("chat", cache_dir, "--repeats", "1", "--max-num-batched-tokens", "64")
    runs = {rec["mode"]: rec for rec in r["run"]}
    modes = {rec["mode"]: rec for rec in r["mode"]}
    assert set(runs) == set(modes) == {"plain", "capture_last_prompt", "capture_last_prompt_one_layer",
                                       "capture_last_prompt_stream", "capture_all_prompt", "capture_generated",
                                       "steer_decode", "cache_off", "shared_prefix_off"}
    for mode, rec in modes.items():
        assert set(rec) == {"bench", "record", "mode", "output_tok_s", "cost_pct_vs_plain"}
        positive(rec, "output_tok_s")
        assert runs[mode]["rows_ok"] and runs[mode]["output_tokens"] == runs["plain"]["output_tokens"]
    assert modes["plain"]["cost_pct_vs_plain"] == 0.0
    hits = {mode: rec["prefix_cache_hit_tokens"][0] for mode, rec in runs.items()}
    assert hits["cache_off"] == 0 < hits["plain"]
    assert all(hits[mode] == hits["plain"] for mode in modes if mode != "cache_off")  # capture keeps the hits
    assert runs["capture_all_prompt"]["activation_store_hits"][0] > 0
    assert all(runs[mode]["num_steps"] == runs["plain"]["num_steps"] for mode in modes if mode != "cache_off")
    positive(r["ratio"][0], "speedup_vs_cache_off", "speedup_vs_cache_on")


BLOCK_TRAINING_LIBRARIES = """import sys
for name in ("sae_lens", "datasets"):
    sys.modules[name] = None  # import fails, as on a machine without them
"""


def test_activation_stream(cache_dir, tmp_path, monkeypatch):
    """The top-k trainer reading a SAELens cache against the same trainer fed by ActivationStream,
    in a process where sae_lens and datasets cannot be imported (the GPU machines lack them)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRAINING_LIBRARIES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = run("activation_stream", cache_dir)
    assert r["cache_write"][0]["windows"] > 0 and r["cache_write"][0]["bytes"] > 0
    assert r["check"][0]["ok"] and r["check"][0]["rows"] > 0 and r["check"][0]["max_abs"] > 0
    assert {x["mode"] for x in r["run"]} == {"cache", "stream"}
    for x in (*r["run"], r["capture_only"][0], r["train_only"][0]):
        positive(x, "seconds", "tok_s")
    ratio = r["ratio"][0]
    positive(ratio, "cache_tok_s", "stream_tok_s", "stream_over_cache")
    assert ratio["target"] == 0.70 and isinstance(ratio["meets"], bool) and ratio["trainer"] == "torch"


def test_activation_stream_trainer_is_saelens_step_for_step():
    """The benchmark's plain-torch trainer and SAELens' TopKTrainingSAE under its SAETrainer, from
    the same seed on the same batches, hold the same weights after every step; the window of dead
    latents is short, so most steps also train the auxiliary loss."""
    import torch

    from benchmarks.topk_trainer import SAELensTrainer, TopKTrainer

    torch.manual_seed(1)
    batches = [3 * torch.randn(8, 16) for _ in range(10)]
    ours = TopKTrainer(16, 256, 2, 8, "cpu", seed=0, dead_feature_window=1)
    dead = []
    for steps, batch in enumerate(batches, 1):
        dead.append(int((ours.since_fired > 1).sum()))
        ours.step(batch)
        lens = SAELensTrainer(16, 256, 2, 8, "cpu", seed=0, dead_feature_window=1)
        lens.fit(iter(batches), 8 * steps)
        for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
            assert torch.equal(getattr(ours, name), getattr(lens.sae, name)), (steps, name)
    assert dead[0] == 0 and min(dead[2:]) > 0  # the auxiliary loss ran from the third step on
    assert not torch.equal(ours.W_dec, TopKTrainer(16, 256, 2, 8, "cpu", seed=0).W_dec)  # it trained


def test_dashboards_against_sparse_capture_and_sae_dashboard(cache_dir):
    r = run("dashboards", cache_dir)
    runs = {x["mode"]: x for x in r["run"]}
    assert list(runs) == ["sparse_capture", "dashboards"]
    for x in runs.values():
        positive(x, "seconds", "prompt_tok_s")
        assert x["tokens"] == r["sae"][0]["tokens"]
    ratio = r["ratio"][0]
    positive(ratio, "dashboards_vs_sparse_capture", "mean_l0")
    assert abs(ratio["mean_l0"] - 64) < 16 and ratio["tokens_seen"] == r["sae"][0]["tokens"]
    sd = r["sae_dashboard"][0]
    positive(sd, "seconds", "ours_same_job_seconds", "scaled_to_all_seconds", "all_features_speedup")
    assert sd["features"] == 64 and sd["max_rel_diff_of_feature_max"] < 0.05  # both found the same maxima


def test_neuronpedia(cache_dir):
    """Steer calls through the Neuronpedia API and the same generations through /v1/completions:
    identical texts, and the throughput ratio the GPU run is judged by."""
    r = run("neuronpedia", cache_dir, model=False)
    runs = {record["mode"]: record for record in r["run"]}
    assert set(runs) == {"completions", "neuronpedia", "neuronpedia_stream"}
    for record in runs.values():
        positive(record, "output_tok_s")
        assert record["generations"] == 8 and record["output_tokens"] == [64] and record["identical_share"] == [1.0]
    positive(r["ratio"][0], "neuronpedia_over_completions", "neuronpedia_stream_over_completions")
