"""``LLM.generate`` checks its prompts up front, queues them, and the scheduler admits them as it
takes them: building their state (steering configs, capture, grammars) overlaps the device's work
on the first steps, every step is the one that admitting them all up front builds, and a bad
prompt late in the list raises its ``ValueError`` before any prompt runs, leaving nothing behind
in any plane."""

import dataclasses
import importlib.util
import random

import pytest
import torch

from steerable import LLM, Add, Clamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.entrypoints.llm import run_to_completion


@pytest.fixture(scope="module")
def llm(model_dirs):
    # A 48-token budget against ~16 prompts of 10-40 tokens: the prompts span many steps, some
    # share a prefix (the cache decides how many tokens a step takes).
    return LLM(model_dirs["qwen2"], device="cpu", kv_cache_tokens=4096, max_model_len=256,
               max_num_batched_tokens=48, max_num_seqs=6)


def _workload(llm, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 200) for _ in range(20)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(5, 200) for _ in range(rng.randrange(10, 25))]
               for i in range(16)]
    hidden = llm.llm_engine.model_config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i in range(len(prompts)):
        vector = torch.randn(hidden, generator=gen) * 0.5
        items = [Add(layer, vector, select=SelectSpec(prompt="all")) for layer in (0, 1)] if i % 2 else \
            [Clamp(1, vector / vector.norm(), min=-0.1, max=0.1)]
        params.append(SamplingParams(max_tokens=4 + i % 5, temperature=0, steering_vectors=SteeringSpec(items)))
    return prompts, params


def _record_steps(engine) -> list:
    """Every step's scheduled (prompt, tokens) pairs, by prompt content (client ids differ per run)."""
    steps = []
    schedule = engine.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(tuple(s.request.prompt_token_ids), s.num_tokens) for s in out.scheduled])
        return out

    engine.scheduler.schedule = recorded
    return steps


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_queued_prompts_build_the_steps_up_front_admission_builds(llm):
    engine = llm.llm_engine
    prompts, params = _workload(llm)
    steps = _record_steps(engine)
    try:
        eager_ids = [f"eager-{i}" for i in range(len(prompts))]
        for client_id, prompt, p in zip(eager_ids, prompts, params):
            engine.add_request(client_id, prompt, p)
        eager = run_to_completion(engine, eager_ids)
        eager_steps = list(steps)
        steps.clear()
        # the prefix cache now holds the prompts: a second eager run is the fair reference
        for client_id, prompt, p in zip(eager_ids, prompts, params):
            engine.add_request(client_id + "-again", prompt, p)
        again = run_to_completion(engine, [c + "-again" for c in eager_ids])
        again_steps = list(steps)
        steps.clear()
        queued = llm.generate(prompts, params, use_tqdm=False)
        queued_steps = list(steps)
    finally:
        del engine.scheduler.schedule
    assert _tokens(eager) == _tokens(again) == _tokens(queued)
    assert len(eager_steps) > 8 and sum(len(s) > 1 for s in eager_steps) > 4  # many steps, mostly batched
    assert queued_steps == again_steps
    assert engine.stats()["num_requests"] == 0 and llm.get_steering_status()["rows_in_use"] == 0


def test_siblings_fanning_out_beside_queued_prompts_get_the_room_and_place_they_get_beside_waiting_ones(llm):
    # an n=3 request from add_request creates its siblings as the batch has room and queues them
    # behind the requests waiting then: prompts queued behind it count and go first as those would
    engine = llm.llm_engine
    prompts, params = _workload(llm, seed=4)
    group_params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=7)

    def run(tag: str, queue: bool) -> tuple[list, list]:
        steps = _record_steps(engine)
        try:
            engine.add_request(f"{tag}-group", prompts[0], group_params)
            ids = [f"{tag}-{i}" for i in range(1, len(prompts))]
            queued = engine.queue_requests(list(zip(ids, prompts[1:], params[1:]))) if queue else None
            if not queue:
                for client_id, prompt, p in zip(ids, prompts[1:], params[1:]):
                    engine.add_request(client_id, prompt, p)
            outs = run_to_completion(engine, [f"{tag}-group", *ids], queued=queued)
        finally:
            del engine.scheduler.schedule
        return [[list(c.token_ids) for c in o.outputs] for o in outs], steps

    run("warm", queue=False)  # the prefix cache as the two compared runs find it
    eager, eager_steps = run("eager", queue=False)
    queued, queued_steps = run("queued", queue=True)
    assert queued_steps == eager_steps and queued == eager and len(eager[0]) == 3


def test_queued_prompts_are_admitted_as_the_scheduler_takes_them(llm):
    engine = llm.llm_engine
    prompts, params = _workload(llm, seed=1)
    ids = [f"q-{i}" for i in range(len(prompts))]
    queued = engine.queue_requests(list(zip(ids, prompts, params)))
    assert engine.has_unfinished_requests() and not engine.groups
    engine.step()  # one step of 48 tokens: a few prompts admitted, the rest still queued
    admitted = len(engine.groups)
    assert 1 <= admitted < len(prompts) and len(queued.entries) == len(prompts) - admitted
    out = run_to_completion(engine, ids, queued=queued)
    assert all(o.finished for o in out) and not queued.entries and queued.error is None
    assert engine.stats()["num_requests"] == 0


def test_a_bad_prompt_late_in_the_queue_raises_and_leaves_nothing(llm):
    engine = llm.llm_engine
    prompts, params = _workload(llm, seed=2)
    hidden = engine.model_config.hidden_size
    params[11] = SamplingParams(max_tokens=3, steering_vectors={1: torch.zeros(hidden + 1)})
    steps_before = engine.stats()["num_steps"]
    with pytest.raises(ValueError, match=r"steering_vectors.*hidden size"):
        llm.generate(prompts, params, use_tqdm=False)
    assert engine.stats()["num_steps"] == steps_before  # refused before any prompt ran
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats["num_requests"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert llm.get_steering_status()["rows_in_use"] == 0 and llm.get_steering_status()["configs_in_use"] == 0
    fine = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in fine)


def test_an_aborted_queue_admits_nothing_more(llm):
    engine = llm.llm_engine
    prompts, params = _workload(llm, seed=3)
    ids = [f"a-{i}" for i in range(len(prompts))]
    queued = engine.queue_requests(list(zip(ids, prompts, params)))
    engine.step()
    engine.abort_request(ids)
    assert not queued.entries and engine.stats()["num_requests"] == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.groups and llm.get_steering_status()["rows_in_use"] == 0


class _Recorder:
    """A capture consumer that notes which requests it was handed."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_capture(self, request_id, stream, tensors, metas) -> None:
        self.seen.append(request_id)

    def close(self) -> None:
        pass


def _planes(llm, recorder: _Recorder) -> dict:
    """Everything a call can leave behind: the engine's counters, each plane's status and the
    rows its streams hold."""
    engine = llm.llm_engine
    streams = {name: llm.capture_status(name) for name in ("hidden_states", "attention_heads", "sae_features")}
    return {"stats": engine.stats(), "steering": llm.get_steering_status(), "streams": streams,
            "structured_live": engine.structured.live, "consumed": list(recorder.seen),
            "unfinished": engine.has_unfinished_requests()}


def test_a_refused_call_leaves_no_trace_in_any_plane(llm):
    """A bad prompt late in the list: the call raises, and no stream, counter, steering row,
    feature store, grammar or consumer shows anything of the prompts before it (issue 48, item 11)."""
    from test_sae_registry import random_sae

    from steerable import CaptureSpec, Feature, StructuredOutputsParams

    engine = llm.llm_engine
    hidden = engine.model_config.hidden_size
    llm.register_sae("refusal-sae", random_sae(d_in=hidden, layer=1))
    recorder = _Recorder()
    llm.add_capture_consumer(recorder)
    llm.start_capture("hidden_states", layers=[1], reduce="mean")
    llm.start_capture("attention_heads", layers=[0])
    llm.start_capture("sae_features", saes=["refusal-sae"], top_k=4)
    try:
        prompts, params = _workload(llm, seed=5)
        for i, p in enumerate(params):  # every plane busy: own captures, feature steering, grammars
            extra = {"capture": CaptureSpec(layers=[0], reduce="last")} if i % 3 == 0 else {}
            if i % 4 == 1:
                extra["steering_vectors"] = [Feature("refusal-sae", i, scale=2.0)]
            if i % 5 == 2 and importlib.util.find_spec("xgrammar"):
                extra["structured_outputs"] = StructuredOutputsParams(choice=["yes", "no"])
            params[i] = dataclasses.replace(p, **extra)
        before = _planes(llm, recorder)
        bad = list(params)
        bad[11] = SamplingParams(max_tokens=3, steering_vectors={1: torch.zeros(hidden + 1)})
        with pytest.raises(ValueError, match=r"steering_vectors.*hidden size"):
            llm.generate(prompts, bad, use_tqdm=False)
        assert _planes(llm, recorder) == before
        good = [p for i, p in enumerate(prompts) if i != 11]
        llm.generate(good, [p for i, p in enumerate(params) if i != 11], use_tqdm=False)
        assert llm.capture_status("hidden_states")["rows_stored"] == {1: len(good)}  # one mean row a request
        assert len(recorder.seen) == sum(1 for i in range(len(prompts)) if i % 3 == 0 and i != 11)
    finally:
        for name in ("hidden_states", "attention_heads", "sae_features"):
            llm.stop_capture(name)
            llm.clear_captured(name)
        llm.remove_capture_consumer(recorder)
        llm.unregister_sae("refusal-sae")


def test_parameters_shared_by_a_call_are_checked_once_and_each_other_object_still_is(llm, monkeypatch):
    """A corpus run queues thousands of prompts with one ``SamplingParams``: its checks run once per
    call; a different object later in the call is still checked, and its bad field refuses the call."""
    engine = llm.llm_engine
    prompts, _ = _workload(llm, seed=3)
    calls, real = [], SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(id(self)) or real(self))
    shared, own = SamplingParams(max_tokens=2), SamplingParams(max_tokens=2)
    outputs = llm.generate(prompts[:10], [shared] * 9 + [own], use_tqdm=False)
    assert len(outputs) == 10 and calls.count(id(own)) >= 1
    assert calls.count(id(shared)) == calls.count(id(own))  # nine prompts' parameters checked as often as one's
    bad = SamplingParams(max_tokens=2)
    bad.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(prompts[:10], [shared] * 9 + [bad], use_tqdm=False)
    stats = engine.stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
