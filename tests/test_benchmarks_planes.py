"""The planes' benchmarks end to end through the runner (``--smoke``: tiny random models, CPU):
corpus capture and its formats, the chat workload, activation streams into a trainer, feature
dashboards and the Neuronpedia API; the numbers are only checked for sanity."""

from __future__ import annotations

import os

import pytest
from bench_harness import positive, run

pytestmark = pytest.mark.slow


def test_capture_corpus_with_hf_baseline(bench_cache_dir):
    r = run("capture_corpus", bench_cache_dir, "--repeats", "2")
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


def test_saelens_cache_with_prefill_and_hf_baselines(bench_cache_dir):
    """The SAELens writer against the engine's own prefill and HF at each batch size; the script
    itself checks the kept dataset's rows and token ids."""
    r = run("saelens_cache", bench_cache_dir, "--repeats", "2")
    assert [x["repeat"] for x in r["prefill"]] == [x["repeat"] for x in r["saelens"]] == [0, 1]
    for x in r["prefill"] + r["saelens"]:
        positive(x, "seconds", "tok_s", "tokens")
    assert r["saelens"][0]["tokens"] == r["prefill"][0]["tokens"] == 12 * 16 and r["saelens"][0]["gb_written"] > 0
    assert [x["batch_size"] for x in r["hf"]] == [2, 4]
    assert r["check"][0]["token_ids_ok"] and r["check"][0]["rows"] == 12 and r["check"][0]["has_state"]
    ratio = r["ratio"][0]
    positive(ratio, "of_prefill", "over_hf")
    assert ratio["hf_best_tok_s"] == max(x["tok_s"] for x in r["hf"])


def test_corpus_shards_overhead(bench_cache_dir):
    """Per-shard overhead in one engine and on two replicas, each part reported."""
    r = run("corpus_shards", bench_cache_dir)
    assert [x["shards"] for x in r["run"]] == [1, 4]
    for x in r["run"] + r["replicas"]:
        positive(x, "capture_ms_per_shard", "overhead_fraction")
        assert {"scheduling_ms_per_shard", "write_ms_per_shard", "commit_ms_per_shard"} <= set(x)
    assert r["replicas"][0]["stats"]["replicas"] == 2 and r["replicas"][0]["shards"] == 4
    assert r["wall"][0]["shards"] == [1, 4]


def test_corpus_host(bench_cache_dir):
    """Corpus capture's host side without a model (the script itself checks that the mapped shard
    holds save_file's tensors)."""
    r = run("corpus_host", bench_cache_dir, model=False)
    for x in r["shard"]:
        positive(x, "gb", "seconds", "gb_s", "deliver_seconds")
    assert {x["mode"] for x in r["shard"]} == {"mapped", "memory_then_save_file"}
    assert [(x["mode"], x.get("threads")) for x in r["file"]][:2] == [("pwrite", 1), ("pwrite", 8)]
    for x in r["file"]:
        positive(x, "gb", "seconds", "gb_s")


def test_chat(bench_cache_dir):
    """Every mode on one engine; a small token budget admits chats over several steps, so the later
    ones hit the system prompt in the prefix cache (CPU: the torch backend has no shared kernel),
    and the all-prompt capture takes those blocks' rows from the activation store."""
    r = run("chat", bench_cache_dir, "--repeats", "1", "--max-num-batched-tokens", "64")
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


def test_activation_stream(bench_cache_dir, tmp_path, monkeypatch):
    """The top-k trainer reading a SAELens cache against the same trainer fed by ActivationStream,
    in a process where sae_lens and datasets cannot be imported (the GPU machines lack them)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRAINING_LIBRARIES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = run("activation_stream", bench_cache_dir)
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


def test_dashboards_chunks_probe(bench_cache_dir):
    """The probe's sweep: one pass record per (chunk rows, switch interval, sink, stream priority),
    against one baseline."""
    r = run("dashboards_chunks", bench_cache_dir, "--switch-intervals", "0.005", "--stream-priorities", "0,-1")
    positive(r["baseline"][0], "seconds", "tokens")
    passes = r["pass"]
    assert [(x["chunk_rows"], x["switch_interval_s"], x["sink"], x["stream_priority"]) for x in passes] == [
        (rows, 0.005, sink, priority) for rows in (40, 64) for sink in ("threaded", "engine") for priority in (0, -1)]
    for x in passes:
        positive(x, "seconds", "dashboards_vs_sparse_capture")


def test_dashboards_against_sparse_capture_and_sae_dashboard(bench_cache_dir):
    r = run("dashboards", bench_cache_dir)
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


def test_neuronpedia(bench_cache_dir):
    """Steer calls through the Neuronpedia API and the same generations through /v1/completions:
    identical texts, and the throughput ratio the GPU run is judged by."""
    r = run("neuronpedia", bench_cache_dir, model=False)
    runs = {record["mode"]: record for record in r["run"]}
    assert set(runs) == {"completions", "neuronpedia", "neuronpedia_stream"}
    for record in runs.values():
        positive(record, "output_tok_s")
        assert record["generations"] == 8 and record["output_tokens"] == [64] and record["identical_share"] == [1.0]
    positive(r["ratio"][0], "neuronpedia_over_completions", "neuronpedia_stream_over_completions")


def test_saelens_split_probe(bench_cache_dir):
    """Per step size: alternated wall runs of prefill and the writer, then the writer under the
    torch profiler (kernel time against wall time) and under cProfile (its largest host functions)."""
    r = run("saelens_split", bench_cache_dir)
    assert [(x["step_tokens"], x["mode"]) for x in r["wall"]] == [
        (step, mode) for step in (32, 64) for mode in ("prefill", "saelens")]
    for x in r["wall"]:
        positive(x, "seconds", "tok_s")
    assert [x["step_tokens"] for x in r["device"]] == [x["step_tokens"] for x in r["host"]] == [32, 64]
    for x in r["device"]:
        positive(x, "wall_s")
        assert 0 <= x["kernel_s"] and 0 <= x["device_busy"] and isinstance(x["top"], list)
    for x in r["host"]:
        positive(x, "wall_s")
        assert 0 < len(x["top"]) <= 15 and all(f["own_s"] >= 0 and f["calls"] > 0 for f in x["top"])
