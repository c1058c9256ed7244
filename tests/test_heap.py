"""frozen_heap: the heap alive before a run is out of the collector's walks during it, and
collectable again after it (nothing leaks); and which runs take it (and ``long_runs.quick_handoff``)."""

import gc
import sys
import weakref

import pytest
import torch

from steerable import (
    LLM,
    ActivationStream,
    SamplingParams,
    capture_corpus,
    feature_dashboards,
    long_runs,
)
from steerable.capture import corpus_run, window_feed
from steerable.engine.engine import LLMEngine
from steerable.long_runs import frozen_heap
from steerable.sae.dashboards import driver
from steerable.sae.model import SAE


class _Node:
    pass


def _cycle() -> weakref.ref:
    node = _Node()
    node.self = node  # only the collector frees a cycle
    return weakref.ref(node)


def test_a_cycle_dropped_during_the_run_is_collected_after_it():
    gc.collect()
    before = gc.get_freeze_count()
    node = _Node()
    node.self = node
    alive = weakref.ref(node)
    with frozen_heap():
        assert gc.get_freeze_count() > before
        del node
        gc.collect()
        assert alive() is not None  # frozen: no collection walks it
    assert gc.get_freeze_count() == before
    gc.collect()
    assert alive() is None


def test_nested_runs_share_one_freeze_undone_by_the_last():
    before = gc.get_freeze_count()
    with frozen_heap():
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > before  # the inner run's end did not unfreeze
    assert gc.get_freeze_count() == before


def test_garbage_made_during_the_run_is_collected_during_it():
    with frozen_heap():
        alive = _cycle()
        gc.collect()
        assert alive() is None


def test_an_error_inside_the_run_still_unfreezes():
    before = gc.get_freeze_count()
    try:
        with frozen_heap():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == before


def test_a_heap_the_application_froze_stays_frozen_after_a_run():
    """No second freeze (an object made after the application's is still walked) and no unfreeze.
    Frozen objects freed meanwhile lower the freeze count, so the checks do not compare counts."""
    gc.freeze()
    try:
        made_after = _Node()
        with frozen_heap():
            assert any(o is made_after for o in gc.get_objects())  # the permanent generation is not listed
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_back_to_back_runs_do_not_keep_the_garbage_of_the_ones_before():
    """Each run's cycles die with it; the next run starts right after, with no full collection
    between them: they must not be frozen into it (a loop of runs would keep them all)."""
    alive = []
    for _ in range(3):
        with frozen_heap():
            assert all(ref() is None for ref in alive)
            alive.append(_cycle())
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_long_runs_step_with_the_heap_frozen_and_generate_does_not(capture_dirs, tmp_path, monkeypatch):
    """The wiring: corpus capture, a dashboards pass and an activation stream step the engine with
    the heap frozen and (on a GPU; here their device is taken for one) the GIL's short switch
    interval; plain ``generate`` does neither (a loop of short calls would pay a full collection
    each); nothing stays frozen or changed after any of them."""
    seen: list[tuple[int, float]] = []
    for module in (corpus_run, window_feed, driver):
        monkeypatch.setattr(module, "quick_handoff", lambda device_type: long_runs.quick_handoff("cuda"))
    previous, default = sys.getswitchinterval(), 0.005
    sys.setswitchinterval(default)
    real_step = LLMEngine.step

    def step(self):
        seen.append((gc.get_freeze_count(), sys.getswitchinterval()))
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)

    def first_batch(stream):
        with stream:  # closing it ends its feed thread, and with it the stream's freeze
            return next(iter(stream))

    llm = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    texts = ["the cat sat on the mat", "a dog ran in the park today", "rain fell on the quiet town"]
    g = torch.Generator().manual_seed(0)
    d = llm.llm_engine.model_config.hidden_size
    llm.register_sae("s", SAE(torch.randn(d, 16, generator=g), torch.zeros(16),
                              torch.nn.functional.normalize(torch.randn(16, d, generator=g), dim=1),
                              torch.zeros(d), "relu", layer=1, hook="post_mlp"))
    try:
        runs = {
            "generate": lambda: llm.generate(texts, SamplingParams(max_tokens=2), use_tqdm=False),
            "capture_corpus": lambda: capture_corpus(llm, texts, tmp_path / "corpus", layers=[1]),
            "feature_dashboards": lambda: feature_dashboards(llm, texts, "s", n_top=2),
            "ActivationStream": lambda: first_batch(ActivationStream(llm, texts, layers=[1], context_size=4,
                                                                     batch_size=4, shuffle_buffer=0, device="cpu")),
        }
        for name, run in runs.items():
            seen.clear()
            run()
            assert seen, name
            long_run = name != "generate"
            assert all(count > 0 for count, _ in seen) == long_run, (name, seen)
            interval = long_runs.RUN_SWITCH_INTERVAL_S if long_run else default
            assert all(i == pytest.approx(interval) for _, i in seen), (name, seen)
            assert gc.get_freeze_count() == 0, name
            assert sys.getswitchinterval() == pytest.approx(default), name
    finally:
        llm.shutdown()
        sys.setswitchinterval(previous)

