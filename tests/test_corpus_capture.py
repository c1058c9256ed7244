"""Corpus capture: shards equal ``steerable.capture`` on the same texts, read back with plain
safetensors; a run interrupted (an injected failure, or a process killed after its first shard)
and resumed writes the same shards as an uninterrupted one."""

import errno
import json
import os
import threading
import time

import pytest
import torch
from conftest import CORPUS
from corpus_harness import kill_after_first_shard
from safetensors.torch import load_file

import steerable
from steerable import LLM, SamplingParams
from steerable.capture import shard_file as corpus_files
from steerable.capture import shard_stores
from steerable.capture.corpus import capture_corpus
from steerable.capture.shard_buffer import ShardRouter
from steerable.engine.engine import LLMEngine
from steerable.entrypoints.cli import main

TEXTS = [f"{i}: {CORPUS[i % 7]}" for i in range(11)]


@pytest.fixture(scope="module")
def llm(capture_dirs):
    return LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048)


def read_shards(out) -> list[dict[str, torch.Tensor]]:
    index = json.loads((out / "index.json").read_text())
    return [load_file(out / entry["file"]) for entry in index["shards"]]


@pytest.mark.parametrize("select", ["all_prompt", "last_prompt", "all", {"prompt_positions": [0, 2, -1]}])
def test_shards_equal_steerable_capture(llm, tmp_path, select):
    index = capture_corpus(llm, TEXTS, tmp_path, layers=[0, 2], select=select, shard_size=4, batch_size=3)
    shards = read_shards(tmp_path)
    assert [e["start"] for e in index["shards"]] == [0, 4, 8] and index["complete"]
    assert [e["rows"] for e in index["shards"]] == [len(s["example"]) for s in shards]
    reference = steerable.capture(llm, TEXTS, layers=[0, 2], select=select)
    for layer in (0, 2):
        assert torch.equal(torch.cat([s[f"layer.{layer}"] for s in shards]), reference.rows(layer))
    meta = reference.meta(0)
    assert torch.equal(torch.cat([s["position"] for s in shards]), meta.positions.long())
    assert torch.equal(torch.cat([s["token_id"] for s in shards]), meta.token_ids.long())
    examples = torch.cat([s["example"] for s in shards])
    assert examples.tolist() == [i for i, out in enumerate(reference.outputs)
                                 for _ in range(len(out.capture_meta["hidden_states"][0]))]
    assert len(examples) > len(TEXTS) or select == "last_prompt"
    saved = json.loads((tmp_path / "index.json").read_text())
    assert saved["layers"] == [0, 2] and saved["hook"] == "post_mlp" and saved["num_examples"] == len(TEXTS)
    assert saved["select"] == steerable.SelectSpec.parse(select).to_wire()


def test_the_engine_does_not_pause_between_shards(llm, tmp_path, monkeypatch):
    """Examples of the next shard join the steps of the current one: some step's rows belong to
    two shards, and each shard still gets exactly its own rows."""
    spans, real_append = [], ShardRouter.append

    def append(self, rows):
        # Owners read before the rows go in: once a shard has all its rows, the run's thread may
        # forget its requests at any moment (this runs on the sink thread).
        owners = {id(self.buffer_of.get(rid) or self.by_client[rid.rpartition("-")[0]][0]) for rid in rows.request_ids}
        real_append(self, rows)
        spans.append(len(owners))

    monkeypatch.setattr(ShardRouter, "append", append)
    capture_corpus(llm, TEXTS, tmp_path, layers=[1], select="all_prompt", shard_size=2, batch_size=5)
    assert max(spans) >= 2
    reference = steerable.capture(llm, TEXTS, layers=[1], select="all_prompt")
    assert torch.equal(torch.cat([s["layer.1"] for s in read_shards(tmp_path)]), reference.rows(1))


def test_stored_dtype_and_hook(llm, tmp_path):
    capture_corpus(llm, TEXTS[:3], tmp_path, layers=[1], hook="pre_attn", dtype="bfloat16")
    shard = read_shards(tmp_path)[0]
    reference = steerable.capture(llm, TEXTS[:3], layers=[1], hook="pre_attn", dtype="bfloat16")
    assert shard["layer.1"].dtype == torch.bfloat16 and torch.equal(shard["layer.1"], reference.rows(1))


def test_shards_equal_steerable_capture_under_preemption(capture_dirs, tmp_path):
    """A request preempted mid-prompt is recomputed; each of its rows still lands once, in place."""
    texts = [" ".join([CORPUS[i % 7]] * 4) for i in range(8)]  # 79 to 119 tokens
    small = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=160, max_num_batched_tokens=64)
    capture_corpus(small, texts, tmp_path, layers=[0, 2], select="all_prompt", shard_size=8, batch_size=8)
    assert small.engine.stats()["num_preemptions"] > 0
    shard = read_shards(tmp_path)[0]
    reference = steerable.capture(LLM(capture_dirs["llama"], device="cpu"), texts, layers=[0, 2], select="all_prompt")
    for layer in (0, 2):
        assert (shard[f"layer.{layer}"] - reference.rows(layer)).abs().max() <= 1e-5
    assert torch.equal(shard["position"], reference.meta(0).positions.long())


def test_a_running_stream_is_refused_and_a_stopped_one_kept(llm, tmp_path):
    llm.start_capture(layers=[1], select="all")
    try:
        with pytest.raises(ValueError, match="hidden_states capture stream is running"):
            capture_corpus(llm, TEXTS[:2], tmp_path / "out")
        assert not (tmp_path / "out").exists()
        llm.generate(TEXTS[:1], use_tqdm=False)
    finally:
        llm.stop_capture()
    capture_corpus(llm, TEXTS[:2], tmp_path / "out", layers=[1], select="all_prompt")
    assert not llm.capture_status()["enabled"]
    tensors, meta = llm.fetch_captured()  # the stopped stream's rows, untouched by the corpus run
    assert len(set(meta[1].req_ids)) == 1 and tensors[1].shape[0] == len(meta[1]) > 0


class Sink:
    def __init__(self, threaded=False, delay=0.0, fail_at=None):
        self.threaded, self.delay, self.fail_at = threaded, delay, fail_at
        self.parts, self.threads = [], set()

    def append(self, rows):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)  # a slow sink: the engine runs ahead of it
        if len(self.parts) == self.fail_at:
            raise RuntimeError("sink broke")
        self.parts.append(rows.block.index_select(1, torch.from_numpy(rows.where)).clone())


@pytest.mark.parametrize("threaded", [False, True])
def test_a_stream_sink_takes_the_rows_a_store_would(llm, threaded):
    with pytest.raises(ValueError, match="sink: takes every selected row"):
        llm.llm_engine.start_capture("hidden_states", [0], None, "last", None, None, "post_mlp", sink=Sink())
    sink = Sink(threaded, delay=0.02 if threaded else 0.0)
    llm.llm_engine.start_capture("hidden_states", [0, 2], None, "all", "all_prompt", None, "post_mlp", sink=sink)
    llm.generate(TEXTS[:3], use_tqdm=False)
    assert llm.fetch_captured() == ({}, {}) and llm.capture_status()["enabled"]
    llm.stop_capture()  # a threaded sink has taken every row when this returns
    assert llm.fetch_captured() == ({}, {}) and not llm.capture_status()["enabled"]  # no store left behind
    assert sink.threads == ({"capture-sink_0"} if threaded else {threading.current_thread().name})
    assert llm.llm_engine.capture.sink_thread is None
    llm.start_capture(layers=[0, 2], select="all_prompt")
    llm.generate(TEXTS[:3], use_tqdm=False)
    llm.stop_capture()
    stored, _ = llm.fetch_captured()
    received = torch.cat(sink.parts, dim=1)
    assert torch.equal(received[0], stored[0]) and torch.equal(received[1], stored[2])


def test_a_threaded_sink_runs_behind_by_at_most_the_host_rows_lifetime(capture_dirs):
    """Step k's rows are read on the sink thread while later steps launch, but always before the
    launch that reuses their host block (the worker keeps them for two more copying launches)."""
    llm = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048, max_num_batched_tokens=16)
    session = llm.llm_engine.capture
    planned, appended, real_plan = [], [], session.plan

    def plan(*args):
        result = real_plan(*args)
        if result is not None:
            planned.append(time.perf_counter())
        return result

    class Slow(Sink):
        def append(self, rows):
            super().append(rows)
            appended.append(time.perf_counter())

    session.plan = plan
    sink = Slow(threaded=True, delay=0.03)
    llm.llm_engine.start_capture("hidden_states", [0], None, "all", "all_prompt", None, "post_mlp", sink=sink)
    llm.generate(TEXTS[:4], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.stop_capture()
    lifetime = llm.llm_engine.worker.host_block_lifetime
    assert lifetime == 2 and len(appended) == len(planned) > 2 * lifetime
    assert all(appended[k] < planned[k + lifetime + 1] for k in range(len(planned) - lifetime - 1))
    assert any(appended[k] > planned[k + 1] for k in range(len(planned) - 1))  # the engine did run ahead


def test_a_failing_threaded_sink_is_raised_and_the_engine_goes_on(llm):
    sink = Sink(threaded=True, fail_at=0)
    llm.llm_engine.start_capture("hidden_states", [1], None, "all", "all_prompt", None, "post_mlp", sink=sink)
    with pytest.raises(Exception, match="sink broke"):
        try:
            llm.generate(TEXTS[:4], use_tqdm=False)  # raised where the engine waits for the sink
        finally:
            llm.stop_capture()  # or here, once every row was offered
    assert llm.llm_engine.capture.sink_thread is None and not llm.capture_status()["enabled"]
    assert llm.engine.stats()["num_requests"] == 0
    assert [o.outputs[0].text for o in llm.generate(TEXTS[:2], use_tqdm=False)]  # still serving


def shard_bytes(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}


class ShortOfSpace(shard_stores.ShardFile):
    """The third shard's file runs out of space after its first chunk of rows."""
    made = 0

    def __init__(self, *args):
        super().__init__(*args)
        ShortOfSpace.made += 1
        self.fails = ShortOfSpace.made == 3

    def allocate(self, chunk_rows=4096):
        if self.fails:
            real, calls, mine = corpus_files.os.posix_fallocate, [], self._fd

            def fallocate(fd, offset, length):  # os is shared: other shards' files allocate meanwhile
                if fd != mine:
                    return real(fd, offset, length)
                calls.append(offset)
                if len(calls) > 1 + len(self.data):  # the labels and chunk 0 of every layer
                    raise OSError(errno.ENOSPC, "No space left on device")
                real(fd, offset, length)

            corpus_files.os.posix_fallocate = fallocate
            try:
                return super().allocate(chunk_rows=2)
            finally:
                corpus_files.os.posix_fallocate = real
        return super().allocate(chunk_rows)


def test_resume_after_a_shard_runs_out_of_space(llm, tmp_path, monkeypatch):
    kwargs = dict(layers=[0, 1, 2], select="all_prompt", shard_size=2, batch_size=2)
    capture_corpus(llm, TEXTS, tmp_path / "whole", **kwargs)
    ShortOfSpace.made = 0
    monkeypatch.setattr(shard_stores, "ShardFile", ShortOfSpace)
    with pytest.raises(OSError, match="could not be reserved"):  # reserved in a thread, raised where rows wait
        capture_corpus(llm, TEXTS, tmp_path / "cut", **kwargs)
    index = json.loads((tmp_path / "cut" / "index.json").read_text())
    assert len(index["shards"]) == 2 and not index["complete"]
    assert not [n for n in os.listdir(tmp_path / "cut") if n.endswith(".part")]
    assert not [t for t in threading.enumerate() if t.name.startswith("corpus-files")]
    assert llm.engine.stats()["num_requests"] == 0 and not llm.capture_status()["enabled"]  # aborted, stopped
    monkeypatch.undo()
    with pytest.raises(ValueError, match="resume"):
        capture_corpus(llm, TEXTS, tmp_path / "cut", **kwargs)
    with pytest.raises(ValueError, match="resume: layers differs"):
        capture_corpus(llm, TEXTS, tmp_path / "cut", **{**kwargs, "layers": [0]}, resume=True)
    capture_corpus(llm, TEXTS, tmp_path / "cut", **kwargs, resume=True)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")


def test_resume_after_a_failure_mid_shard_while_the_next_file_is_allocated(llm, tmp_path, monkeypatch):
    kwargs = dict(layers=[1, 2], select="all_prompt", shard_size=4, batch_size=2)
    capture_corpus(llm, TEXTS, tmp_path / "whole", **kwargs)
    real_step, events = llm.engine.step, []

    class Slow(shard_stores.ShardFile):
        made = 0

        def allocate(self, chunk_rows=4096):
            Slow.made += 1
            if Slow.made == 3:  # shard 2's file: still being allocated when shard 1 fails
                time.sleep(1.0)
            super().allocate(chunk_rows)
            events.append("allocated")

    def failing_step():
        events.append("step")
        if events.count("step") == 3:  # in shard 1 (queued whole; shard 0's outputs come with step 2)
            events.append("failed")
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(shard_stores, "ShardFile", Slow)
    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="device lost"):
        capture_corpus(llm, TEXTS, tmp_path / "cut", **kwargs)
    assert events[-2:] == ["failed", "allocated"]  # the allocation was in flight when the capture failed
    index = json.loads((tmp_path / "cut" / "index.json").read_text())
    assert [e["shard"] for e in index["shards"]] == [0] and not index["complete"]
    assert sorted(os.listdir(tmp_path / "cut")) == ["index.json", "shard-00000.safetensors"]  # no .part left
    assert llm.engine.stats()["num_requests"] == 0 and not llm.capture_status()["enabled"]  # aborted, stopped
    monkeypatch.undo()
    capture_corpus(llm, TEXTS, tmp_path / "cut", **kwargs, resume=True)
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")


def test_resume_after_the_process_is_killed(capture_dirs, tmp_path):
    texts = [f"{i} {CORPUS[i % 7]}" for i in range(60)]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    args = ["capture", "--model", capture_dirs["llama"], "--input", str(tmp_path / "texts.jsonl"), "--field",
            "body", "--layers", "0-2", "--select", '{"prompt": "all"}', "--shard-size", "1", "--batch-size", "1",
            "--device", "cpu", "--kv-cache-tokens", "1024"]
    cut = kill_after_first_shard([*args, "--out", str(tmp_path / "cut")], tmp_path / "cut" / "index.json")
    assert 1 <= len(cut["shards"]) < len(texts) and not cut["complete"]  # killed mid-run
    assert main([*args, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert shard_bytes(tmp_path / "cut") == shard_bytes(tmp_path / "whole")
    assert main([*args, "--out", str(tmp_path / "whole")]) == 2  # without --resume: refused


@pytest.mark.parametrize("kwargs, field", [
    (dict(layers=[3]), "layers"), (dict(hook="mlp"), "hook"), (dict(select="some"), "select"),
    (dict(dtype="int8"), "dtype"), (dict(shard_size=0), "shard_size"), (dict(texts=[]), "texts"),
])
def test_bad_arguments_write_nothing(llm, tmp_path, kwargs, field):
    texts = kwargs.pop("texts", TEXTS)
    with pytest.raises(ValueError, match=field):
        capture_corpus(llm, texts, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_shutdown_with_a_failing_threaded_sink_still_running(capture_dirs, caplog):
    llm = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=1024)
    sink = Sink(threaded=True, delay=0.2, fail_at=0)
    llm.llm_engine.start_capture("hidden_states", [0], None, "all", "all_prompt", None, "post_mlp", sink=sink)
    llm.generate(TEXTS[:2], SamplingParams(max_tokens=1), use_tqdm=False)  # one step: nothing waits for the sink
    assert llm.llm_engine.capture.sink_thread is not None  # its append is still running, and will fail
    llm.shutdown()  # the failure is logged, not raised; nothing is left running
    assert not [t for t in threading.enumerate() if t.name.startswith("capture-sink")]
    assert "capture sink failed" in caplog.text and sink.threads == {"capture-sink_0"}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_files_follow_the_umask(llm, tmp_path, umask):
    """Every file a run writes for others to read gets the permissions any file of the process gets
    (a cluster's other users read them), not ``mkstemp``'s or ``save_file``'s 0600: corpus shards
    and their index in each format, a consumer's shards, feature dashboards and control vectors."""
    from test_sae_registry import random_sae

    from steerable import CaptureSpec, feature_dashboards
    from steerable.capture import FilesystemConsumer
    from steerable.vectors import ControlVector

    hidden = llm.model_config.hidden_size
    old = os.umask(umask)
    try:
        capture_corpus(llm, TEXTS[:3], tmp_path / "acts", layers=[1], select="all_prompt", shard_size=2)
        capture_corpus(llm, TEXTS[:3], tmp_path / "saelens", layers=[1], format="saelens", context_size=8)
        consumer = FilesystemConsumer(tmp_path / "consumed")
        llm.add_capture_consumer(consumer)
        try:
            llm.generate("Hello", SamplingParams(max_tokens=1, capture=CaptureSpec(layers=[1])), use_tqdm=False)
        finally:
            llm.remove_capture_consumer(consumer)
        llm.register_sae("umask-sae", random_sae(d_in=hidden, d_sae=16, layer=1))
        try:
            feature_dashboards(llm, TEXTS[:3], sae="umask-sae", n_top=2, quantiles=2, n_quantile=1, n_logits=2,
                               bins=4, out=tmp_path / "dashboards")
        finally:
            llm.unregister_sae("umask-sae")
        vector = ControlVector({1: torch.ones(hidden)})
        vector.save(tmp_path / "v.safetensors")
        vector.save(tmp_path / "v.gguf")
    finally:
        os.umask(old)
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert {"shard-00001.safetensors", "index.json", "state.safetensors", "v.safetensors", "v.gguf"} <= \
        {path.name for path in written} and len(consumer.paths) == 1 and len(written) > 12
    assert {str(path.relative_to(tmp_path)): oct(path.stat().st_mode & 0o777) for path in written} == \
        {str(path.relative_to(tmp_path)): oct(0o666 & ~umask) for path in written}


def test_a_gpu_run_that_cannot_build_a_step_ahead_is_warned_about():
    """With at most a step's windows in the engine, the next step finds nothing to schedule until
    the one before is collected (the device then waits for the host): said on a GPU, with the fix."""
    from types import SimpleNamespace

    def engine(device, seqs, tokens=32768):
        return SimpleNamespace(device=torch.device(device) if device == "cpu" else SimpleNamespace(type=device),
                               scheduler=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens))

    def spec(batch_size, context_size=128):
        return SimpleNamespace(context_size=context_size, batch_size=batch_size)

    from steerable.capture.corpus_run import serial_steps_warning

    warning = serial_steps_warning(engine("cuda", 256), spec(256))
    assert "up to 256 windows" in warning and "at least 512" in warning
    assert "max_num_seqs 256" in serial_steps_warning(engine("cuda", 256), spec(1024))
    assert "batch_size 64" in serial_steps_warning(engine("cuda", 1024), spec(64))
    assert serial_steps_warning(engine("cuda", 512), spec(512)) is None
    assert serial_steps_warning(engine("cuda", 256, tokens=8192), spec(256)) is None  # 64 a step
    assert serial_steps_warning(engine("cpu", 256), spec(256)) is None  # a CPU's forward is synchronous
    assert serial_steps_warning(engine("cuda", 256), spec(256, context_size=None)) is None  # texts of any length


def test_a_step_is_built_ahead_only_with_more_windows_in_the_engine_than_a_step_takes(capture_dirs, tmp_path,
                                                                                        monkeypatch):
    """What the warning above says, on the scheduler itself: with a step's windows in the engine every
    step is followed by a launch that finds nothing (the step before must be collected first); with
    twice as many, steps follow each other and only the last launch finds nothing."""
    launches, real = [], LLMEngine._launch_next
    monkeypatch.setattr(LLMEngine, "_launch_next", lambda self: launches.append(real(self)) or launches[-1])
    windows = [[1] + [(7 * i + j) % 50 + 2 for j in range(15)] for i in range(16)]  # 16 windows of 16 tokens
    for seqs, empty in ((4, 4), (8, 1)):
        small = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=1024, max_num_batched_tokens=64,
                    max_num_seqs=seqs)
        launches.clear()
        capture_corpus(small, windows, tmp_path / str(seqs), format="saelens", context_size=16, layers=[0],
                       batch_size=seqs)
        small.shutdown()
        assert launches.count(True) == 4 and launches.count(False) == empty, (seqs, launches)
