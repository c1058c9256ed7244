"""The CPU engine's intra-op thread count (what is asked for, else the cores free at start), the
step budget that follows it, and the weights packed while the engine starts."""

import os

import pytest
import torch

from steerable import cpu_threads


def test_requested_count_wins(monkeypatch):
    monkeypatch.delenv(cpu_threads.ENV, raising=False)
    assert cpu_threads.choose(3) == 3
    monkeypatch.setenv(cpu_threads.ENV, "2")
    assert cpu_threads.choose(None) == 2 and cpu_threads.choose(5) == 5


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_counts_name_the_knob(bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        cpu_threads.choose(bad)


def test_bad_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv(cpu_threads.ENV, "many")
    with pytest.raises(ValueError, match=cpu_threads.ENV):
        cpu_threads.choose(None)


def test_loaded_cores_are_left_alone(monkeypatch):
    """Busy cores (the load average) are subtracted; never fewer than one thread, split over ranks."""
    monkeypatch.delenv(cpu_threads.ENV, raising=False)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 8)
    for load, expected in ((0.0, 8), (2.2, 6), (7.9, 1), (30.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert cpu_threads.choose(None) == expected
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cpu_threads.choose(None, ranks_sharing=2) == 4


def test_engine_applies_it(model_dirs):
    from steerable import LLM

    before = torch.get_num_threads()
    try:
        with LLM(model_dirs["llama"], dtype="float32", device="cpu", cpu_threads=1, kv_cache_tokens=256):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_threads"):
        LLM(model_dirs["llama"], device="cpu", cpu_threads=0)


def test_step_budget_follows_the_threads():
    """A CPU step's tokens scale with the engine's threads, so a step takes about as long on any
    core count (128 tokens of SmolLM2-135M a thread), between 64 and vLLM's 8192."""
    from types import SimpleNamespace

    from steerable.config import EngineConfig

    smollm2 = SimpleNamespace(multiply_adds_per_token=lambda: 30 * (576 * 64 * 2 * 12 + 3 * 576 * 1536) + 49152 * 576)
    huge = SimpleNamespace(multiply_adds_per_token=lambda: 10**12)
    config, cpu = EngineConfig(model="m"), torch.device("cpu")
    assert [config.resolve_step_tokens(cpu, smollm2, t) for t in (1, 2, 3, 4, 64)] == [128, 256, 256, 512, 8192]
    assert config.resolve_step_tokens(cpu, huge, 16) == 64
    assert config.resolve_step_tokens(torch.device("cuda"), smollm2, 1) == 8192
    assert EngineConfig(model="m", max_num_batched_tokens=100).resolve_step_tokens(cpu, smollm2, 1) == 100


def test_weights_are_packed_while_the_engine_starts(model_dirs):
    """The first request pays no oneDNN reorder: the start-up step packed every projection."""
    from steerable import LLM

    before = torch.get_num_threads()
    try:
        with LLM(model_dirs["llama"], dtype="float32", device="cpu", cpu_threads=1, kv_cache_tokens=256) as llm:
            weights = [p for name, p in llm.llm_engine.worker.model.named_parameters() if name.endswith("proj.weight")]
            assert weights and all(hasattr(w, "_onednn_packed") for w in weights)
    finally:
        torch.set_num_threads(before)
