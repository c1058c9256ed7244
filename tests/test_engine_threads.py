"""A thread-safe engine with a lifecycle (issue 9 §3): control-plane calls from other threads while
the engine steps, requests admitted from other threads, a step that fails, shutdown."""

import random
import threading

import pytest
import torch

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.errors import EngineError

PROMPTS = [[5 + i, 17, 33 + i, 8, 90 - i, 12] for i in range(8)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen2"], device="cpu", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def baseline(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _hammer(llm, stop: threading.Event, seed: int, errors: list, extra: list) -> list[threading.Thread]:
    hidden = llm.llm_engine.model_config.hidden_size
    rng = random.Random(seed)

    def vec():
        return torch.randn(hidden, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    def guarded(fn):
        def run():
            try:
                while not stop.is_set():
                    fn()
            except Exception as err:  # noqa: BLE001 - reported to the test
                errors.append(err)
        return run

    def steering():
        llm.set_steering_vectors({0: vec()})
        llm.get_steering_status()
        llm.clear_steering_vectors()

    def modules():
        llm.register_steering_modules({"m": {1: vec()}})
        llm.list_steerable_layers()
        llm.unregister_steering_modules("m")

    def capture():
        llm.start_capture("hidden_states", layers=[0], select="last_prompt")
        llm.capture_status("hidden_states")
        llm.fetch_captured("hidden_states")
        llm.stop_capture("hidden_states")
        llm.clear_captured("hidden_states")

    def admit():  # requests from another thread join the batch the main thread is stepping
        if len(extra) < 6:
            rid = f"extra-{seed}-{len(extra)}"
            llm.llm_engine.add_request(rid, [7, 8, 9, len(extra)], SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True, capture=CaptureSpec(layers=[1])))
            extra.append(rid)
        stop.wait(0.001)

    return [threading.Thread(target=guarded(f)) for f in (steering, modules, capture, admit)]


def test_control_plane_from_threads_while_stepping(llm, baseline):
    engine = llm.llm_engine
    for iteration in range(20):
        stop, errors, extra = threading.Event(), [], []
        for i, prompt in enumerate(PROMPTS):  # admitted before any change: they keep this snapshot
            engine.add_request(f"r{iteration}-{i}", prompt, GREEDY)
        threads = _hammer(llm, stop, iteration, errors, extra)
        for t in threads:
            t.start()
        outputs = {}
        try:
            while engine.has_unfinished_requests() or len(outputs) < len(PROMPTS):
                for out in engine.step():
                    outputs[out.request_id] = out
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        while engine.has_unfinished_requests():  # requests added after the loop's last check
            for out in engine.step():
                outputs[out.request_id] = out
        assert [outputs[f"r{iteration}-{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == baseline
        for rid in extra:
            out = outputs[rid]
            assert out.finished and len(out.outputs[0].token_ids) == 4
            assert out.captures["hidden_states"][1].shape[0] == 4 + 3  # every input row, labelled
    llm.stop_capture("hidden_states")
    llm.clear_captured("hidden_states")
    status, stats = llm.get_steering_status(), engine.stats()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0 and not status["modules"]
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert llm.capture_status("hidden_states")["pending_reductions"] == 0


class _FailingConsumer:
    def on_capture(self, request_id, stream, tensors, meta):
        raise RuntimeError("disk full")

    def close(self):
        pass


def test_a_failed_step_finishes_everything_and_the_engine_recovers(llm, baseline):
    engine = llm.llm_engine
    consumer = _FailingConsumer()
    llm.add_capture_consumer(consumer)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, capture=CaptureSpec(layers=[0]),
                             steering_vectors={0: [0.5] * engine.model_config.hidden_size})] + [GREEDY] * 3
    try:
        with pytest.raises(EngineError, match="disk full"):
            llm.generate(PROMPTS[:4], params, use_tqdm=False)
    finally:
        llm.remove_capture_consumer(consumer)
    stats = engine.stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    assert llm.get_steering_status()["rows_in_use"] == 0
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == baseline


def test_a_failed_launch_reports_error_outputs(llm, baseline, monkeypatch):
    engine = llm.llm_engine
    launch = engine.worker.launch
    calls = []

    def flaky(step):
        calls.append(step.step_id)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return launch(step)

    monkeypatch.setattr(engine.worker, "launch", flaky)
    group = engine.add_request("watched", PROMPTS[0], GREEDY)
    with pytest.raises(EngineError, match="device lost"):
        while engine.has_unfinished_requests():
            engine.step()
    assert group.finished and group.children[0].finish_reason == "error"
    monkeypatch.setattr(engine.worker, "launch", launch)
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == baseline[0]
