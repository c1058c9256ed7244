"""A ControlVector steers wherever a spec is accepted, exactly as the same tensors passed inline;
``--control-vector FILE:SCALE`` flags sum per layer as llama.cpp does."""

import pytest
import torch
from conftest import PROMPTS

from steerable import LLM, SamplingParams
from steerable.entrypoints.cli import main
from steerable.errors import InvalidRequestError
from steerable.vectors import ControlVector, combine_control_vectors, parse_control_vector_arg

GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=4096)


def vector(seed: int, layers=(0, 1, 2), scale: float = 4.0) -> ControlVector:
    g = torch.Generator().manual_seed(seed)
    return ControlVector({layer: torch.randn(64, generator=g) * scale for layer in layers})


def run(llm, **params):
    out = llm.generate(PROMPTS[:3], SamplingParams(**GREEDY, **params), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs])
            for o in out]


def test_loaded_vector_steers_as_the_same_tensors_inline(llm, tmp_path):
    cv = vector(0, layers=(1, 2))
    cv.save(tmp_path / "v.gguf")
    loaded = ControlVector.load(tmp_path / "v.gguf", llm)
    inline = run(llm, steering_vectors={1: cv.directions[1].tolist(), 2: cv.directions[2].numpy()})
    assert run(llm, steering_vectors=loaded) == inline
    assert run(llm) != inline  # the vector does change the output
    llm.register_steering_modules({"x": loaded})
    try:
        assert run(llm, steering_module_ref="x") == inline
        assert run(llm, steering_module_ref=("x", 0.5)) == run(llm, steering_vectors=loaded * 0.5)
    finally:
        llm.unregister_steering_modules(["x"])
    llm.set_steering_vectors(loaded)
    try:
        assert run(llm) == inline
    finally:
        llm.clear_steering_vectors()


def test_relative_scale_and_other_hooks_inline(llm):
    cv = ControlVector(vector(1, layers=(0, 2)).directions, "pre_attn", {"residual_norm": {0: 2.0, 2: 5.0}})
    spec = {"pre_attn": {layer: v * (norm / float(v.norm())) * 0.5  # length 0.5 * norm, same rounding
                         for (layer, v), norm in zip(cv.directions.items(), (2.0, 5.0))}}
    assert run(llm, steering_vectors=cv.to_spec(0.5, relative=True)) == run(llm, steering_vectors=spec)


def test_vector_that_does_not_fit_the_model(llm, tmp_path):
    vector(2, layers=(1, 7)).save(tmp_path / "deep.gguf")
    with pytest.raises(InvalidRequestError, match=r"deep.gguf: layers \[7\] do not exist"):
        ControlVector.load(tmp_path / "deep.gguf", llm)
    ControlVector({1: torch.ones(32)}).save(tmp_path / "narrow.gguf")
    with pytest.raises(InvalidRequestError, match="narrow.gguf: width 32"):
        ControlVector.load(tmp_path / "narrow.gguf", llm)
    with pytest.raises(ValueError, match="steering_vectors.*layer"):  # unchecked, it fails at admission
        llm.generate("x", SamplingParams(steering_vectors=ControlVector.load(tmp_path / "deep.gguf")), use_tqdm=False)
    assert not llm.engine.requests


@pytest.mark.parametrize("text, parsed", [("a.gguf:1.5", ("a.gguf", 1.5)), ("b.gguf:-0.5", ("b.gguf", -0.5)),
                                          ("c.gguf", ("c.gguf", 1.0)), ("dir:x/c.gguf", ("dir:x/c.gguf", 1.0))])
def test_parse_control_vector_arg(text, parsed):
    assert parse_control_vector_arg(text) == parsed


def test_combined_files_are_the_scaled_sum_in_the_layer_range(tmp_path):
    a, b = vector(3, layers=(1, 2)), vector(4, layers=(0, 2))
    a.save(tmp_path / "a.gguf")
    b.save(tmp_path / "b.safetensors")
    specs = [f"{tmp_path / 'a.gguf'}:1.5", f"{tmp_path / 'b.safetensors'}:-0.5"]
    total = combine_control_vectors(specs)
    assert total.layers == [0, 1, 2]
    assert torch.equal(total.directions[2], a.directions[2] * 1.5 + b.directions[2] * -0.5)
    assert torch.equal(total.directions[0], b.directions[0] * -0.5)
    ranged = combine_control_vectors(specs, (1, 2))
    assert ranged.layers == [1, 2] and torch.equal(ranged.directions[2], total.directions[2])
    with pytest.raises(InvalidRequestError, match="control_vector_layer_range"):
        combine_control_vectors(specs, (2, 1))
    with pytest.raises(InvalidRequestError, match="missing.gguf"):
        combine_control_vectors([f"{tmp_path / 'missing.gguf'}:2"])


def cli_text(capsys, *args) -> list[str]:
    assert main(["generate", *args]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if not line.startswith(">>>")]


def test_cli_control_vectors_equal_the_summed_spec(llm, model_dirs, tmp_path, capsys):
    a, b = vector(5), vector(6)
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    common = ["--model", model_dirs["llama"], "--device", "cpu", "--kv-cache-tokens", "1024", "--raw",
              "--max-tokens", "8", "--prompt", PROMPTS[1]]
    steered = cli_text(capsys, *common, "--control-vector", f"{tmp_path / 'a.safetensors'}:1.5",
                       "--control-vector", f"{tmp_path / 'b.safetensors'}:-0.5",
                       "--control-vector-layer-range", "1", "2")
    summed = {layer: 1.5 * a.directions[layer] - 0.5 * b.directions[layer] for layer in (1, 2)}
    expected = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, steering_vectors=summed),
                            use_tqdm=False)[0].outputs[0].text.strip()
    plain = llm.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0),
                         use_tqdm=False)[0].outputs[0].text.strip()
    assert steered[0] == expected != plain


@pytest.mark.parametrize("flags, message", [
    (["--control-vector", "nowhere.gguf"], "nowhere.gguf"),
    (["--control-vector-layer-range", "1", "2"], "needs at least one --control-vector"),
    (["--control-vector", "x.npy:2"], "must end in .gguf or .safetensors"),
])
def test_cli_bad_control_vectors_fail_before_loading(flags, message, capsys):
    assert main(["generate", "--model", "no-such-model-dir", *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_vector_that_does_not_fit(model_dirs, tmp_path, capsys):
    vector(7, layers=(5,)).save(tmp_path / "deep.gguf")
    assert main(["generate", "--model", model_dirs["llama"], "--device", "cpu", "--kv-cache-tokens", "256",
                 "--control-vector", str(tmp_path / "deep.gguf")]) == 2
    assert "--control-vector: layers [5] do not exist" in capsys.readouterr().err
