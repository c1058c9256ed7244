"""Feature dashboards on Ray (``steerable.ray.dashboards``, one local cluster, CPU replicas): shards
on two replicas, merged as they come back, equal one process's run field for field; a run killed
in one process resumes on Ray from its checkpoint; a replica's bad-input error names its field; the
CLI's ``--ray`` writes the same directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from server_harness import ROOT
from test_dashboards_server import ARGS, TEXTS
from test_sae_registry import random_sae, save_saelens

from steerable import LLM, SAE, feature_dashboards
from steerable.sae.dashboards import FeatureDashboards

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster and an engine per replica

ENGINE = {"device": "cpu", "kv_cache_tokens": 4096}
CORPUS = [f"{i}: {TEXTS[i % len(TEXTS)]}" for i in range(20)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def made(model_dirs, tmp_path_factory):
    path = save_saelens(random_sae(layer=1, hook="post_mlp", apply_b_dec_to_input=True, seed=4),
                        tmp_path_factory.mktemp("ray-sae") / "res1")
    llm = LLM(model_dirs["qwen3"], **ENGINE)
    llm.register_sae("res1", SAE.load(path))
    return path, llm, feature_dashboards(llm, CORPUS, "res1", model=model_dirs["qwen3"], **ARGS)


def same(a: FeatureDashboards, b: FeatureDashboards) -> None:
    assert a.features == b.features and a.tokens == b.tokens and a.dead == b.dead
    for f in a.features:
        assert json.dumps(a[f].to_dict()) == json.dumps(b[f].to_dict()), f


def test_replicas_equal_one_process(cluster, model_dirs, made, tmp_path, monkeypatch):
    from steerable.ray.dashboards import feature_dashboards_on_ray

    path, llm, whole = made
    on_ray = feature_dashboards_on_ray(model_dirs["qwen3"], CORPUS, path, replicas=2, engine_kwargs=ENGINE,
                                       sae_name="res1", shard_size=3, **ARGS)
    same(whole, on_ray)
    # Killed after two shards in one process, resumed on Ray.
    import steerable.sae.dashboards.files as files

    real, calls = files.checkpoint, []

    def dies_after_two(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("killed")
    monkeypatch.setattr(files, "checkpoint", dies_after_two)
    with pytest.raises(Exception, match="killed"):
        feature_dashboards(llm, CORPUS, "res1", out=tmp_path / "d", shard_size=3, model=model_dirs["qwen3"], **ARGS)
    monkeypatch.setattr(files, "checkpoint", real)
    resumed = feature_dashboards_on_ray(model_dirs["qwen3"], CORPUS, path, replicas=2, engine_kwargs=ENGINE,
                                        sae_name="res1", shard_size=3, out=tmp_path / "d", resume=True, **ARGS)
    same(whole, resumed)
    same(whole, FeatureDashboards.load(tmp_path / "d"))
    with pytest.raises(ValueError, match="n_top"):
        feature_dashboards_on_ray(model_dirs["qwen3"], CORPUS, path, engine_kwargs=ENGINE, **{**ARGS, "n_top": 0})


def test_cli_ray_flag(model_dirs, made, tmp_path):
    path, _, whole = made
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    cmd = [sys.executable, "-m", "steerable.entrypoints.cli", "dashboards", model_dirs["qwen3"], "--sae", path,
           "--input", str(corpus), "--out", str(tmp_path / "d"), "--device", "cpu", "--kv-cache-tokens", "4096",
           "--ray", "2", "--shard-size", "4", "--n-top", "5", "--context", "4,2", "--quantiles", "4",
           "--n-quantile", "2", "--bins", "10", "--n-logits", "6"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    same(whole, FeatureDashboards.load(tmp_path / "d"))
