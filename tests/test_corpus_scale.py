"""Corpus capture on several engines: ``replicas=2`` and ``ray="local"`` (a local Ray cluster of two
CPUs, CPU actors) write the very files one engine writes; a replica killed mid-run has its shard
redone by the other; a run whose driver is killed resumes to the same files."""

import json
import logging
import os
import signal

import pytest
from conftest import CORPUS
from corpus_harness import kill_after_first_shard

import steerable
from steerable.entrypoints.cli import main

pytestmark = pytest.mark.slow

TEXTS = [f"{i}: {CORPUS[i % 7]}" for i in range(48)]
N = 16
OPTIONS = dict(format="saelens", context_size=N, layers=[0, 2], shard_size=2, batch_size=4, dtype="float32")


def files(out):
    return {name: (out / name).read_bytes() if (out / name).is_file() else None for name in sorted(os.listdir(out))}


@pytest.fixture(scope="module")
def engine_kwargs(capture_dirs):
    return dict(model=capture_dirs["llama"], device="cpu", kv_cache_tokens=1024)


@pytest.fixture(scope="module")
def one_engine(engine_kwargs, tmp_path_factory):
    """The dataset one in-process engine writes: what every other way must reproduce."""
    out = tmp_path_factory.mktemp("one") / "out"
    index = steerable.capture_corpus(engine_kwargs, TEXTS, out, **OPTIONS)
    assert len(index["shards"]) > 8
    return files(out)


def test_two_replicas_write_the_one_engine_dataset(engine_kwargs, one_engine, tmp_path):
    index = steerable.capture_corpus(engine_kwargs, TEXTS, tmp_path, replicas=2, **OPTIONS)
    stats = index["stats"]
    assert (stats["replicas"], stats["replicas_died"], stats["shards_redone"]) == (2, 0, 0)
    assert stats["step_seconds"] > 0 and stats["scheduling_seconds"] >= 0  # both replicas reported their times
    assert files(tmp_path) == one_engine


class KillOnHandOut(logging.Handler):
    """Kills a replica the moment the driver hands it a shard, once some shard is committed: it
    dies holding that shard (and whatever it held already)."""

    def __init__(self, index_path):
        super().__init__(logging.DEBUG)
        self.index_path, self.killed = index_path, None

    def emit(self, record):
        if self.killed is None and record.getMessage().startswith("replica") and self.index_path.exists() and \
                json.loads(self.index_path.read_text())["shards"]:
            self.killed = record.args[1]
            os.kill(self.killed, signal.SIGKILL)


def test_a_replica_killed_mid_run_has_its_shards_redone(engine_kwargs, one_engine, tmp_path):
    log = logging.getLogger("steerable.capture.replicas")
    killer = KillOnHandOut(tmp_path / "index.json")
    log.addHandler(killer)
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        index = steerable.capture_corpus(engine_kwargs, TEXTS, tmp_path, replicas=2, **OPTIONS)
    finally:
        log.removeHandler(killer)
        log.setLevel(level)
    assert killer.killed is not None
    assert index["stats"]["replicas_died"] == 1 and index["stats"]["shards_redone"] >= 1
    assert files(tmp_path) == one_engine  # nothing lost, nothing twice, no file of the dead replica left


def test_replicas_killed_with_their_driver_then_resumed(engine_kwargs, one_engine, tmp_path):
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = ["capture", engine_kwargs["model"], "--input", str(tmp_path / "corpus.jsonl"), "--format", "saelens",
            "--context-size", str(N), "--layers", "0,2", "--shard-size", "2", "--batch-size", "4", "--dtype", "float32",
            "--device", "cpu", "--kv-cache-tokens", "1024", "--replicas", "2", "--out", str(tmp_path / "out")]
    cut = kill_after_first_shard(args, tmp_path / "out" / "index.json")  # its replicas end with it
    assert cut["shards"] and not cut["complete"]
    assert main([*args, "--resume"]) == 0
    assert files(tmp_path / "out") == one_engine


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_local_writes_the_one_engine_dataset_to_a_url(engine_kwargs, one_engine, tmp_path, ray_cluster):
    index = steerable.capture_corpus(engine_kwargs, TEXTS, f"file://{tmp_path}/out", ray="local", replicas=2,
                                     **OPTIONS)
    assert index["stats"]["actors"] == 2 and index["stats"]["actors_lost"] == 0
    assert files(tmp_path / "out") == one_engine


def test_delphi_on_replicas_is_the_one_engine_cache(engine_kwargs, tmp_path):
    """The SAE travels to each replica; the latent cache is the one a single engine writes."""
    from test_corpus_formats import random_topk_sae

    options = dict(format="delphi", sae=random_topk_sae(layer=1), context_size=N, shard_size=3, n_splits=2)
    steerable.capture_corpus(engine_kwargs, TEXTS, tmp_path / "one", **options)
    index = steerable.capture_corpus(engine_kwargs, TEXTS, tmp_path / "two", replicas=2, **options)
    assert index["stats"]["replicas"] == 2 and index["complete"]
    hookpoint = "blocks.1.hook_resid_post"
    one, two = (files(tmp_path / run / hookpoint) for run in ("one", "two"))
    assert sorted(one) == [".steerable", "0_47.safetensors", "48_95.safetensors", "config.json"]
    assert {k: v for k, v in one.items() if k != ".steerable"} == {k: v for k, v in two.items() if k != ".steerable"}
