"""The MLP's hook points, ``mlp_in`` (its input after its norm) and ``mlp_out`` (what the MLP block
adds to the residual: after Gemma's and OLMo-2's post-feed-forward norm, the experts' sum on MoE
layers), on every family: captures equal HF hooks on the MLP module's input and output, and Add /
Clamp there equal the same edits made by those hooks (greedy tokens, logprobs <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap
from test_qwen3_moe import build_qwen3_moe

from steerable import LLM, Add, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec

N = 6
ALL_FAMILIES = [*FAMILIES, "qwen3_moe"]


def _vec(seed: int, scale: float) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("moe_points") / "qwen3_moe")
    build_qwen3_moe(path, seed=7, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1)
    return path


def _path(family: str, dirs: dict[str, str], moe_dir: str) -> str:
    return moe_dir if family == "qwen3_moe" else dirs[family]


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_captures_equal_hf_hooks_on_the_mlp(family, capture_dirs, moe_dir):
    path = _path(family, capture_dirs, moe_dir)
    llm = LLM(path, device="cpu", kv_cache_tokens=2048)
    layers = list(range(llm.engine.model_config.num_layers))
    try:
        specs = [CaptureSpec(hook=hook, select="all") for hook in ("mlp_in", "mlp_out")]
        outs = {}
        for spec in specs:  # one hidden-state capture per request: each hook in a run of its own
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=spec)
            outs[spec.hook] = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    out = outs["mlp_in"]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    assert outs["mlp_out"].outputs[0].token_ids == out.outputs[0].token_ids
    ref: dict = {}
    HFSteered(hf_model(path), []).forward(torch.tensor([ids]), len(out.prompt_token_ids), ref)
    for hook, captured in outs.items():
        tensors, metas = captured.captures["hidden_states"], captured.capture_meta["hidden_states"]
        assert sorted(tensors) == layers
        for layer, rows in tensors.items():
            expected = ref[(hook, layer)][:-1]
            assert metas[layer].positions.tolist() == list(range(len(ids) - 1))
            torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-4)
            assert expected.abs().max() > 1e-2  # the values are not all (near) zero
    # mlp_in is the normed residual (OLMo-2's MLP reads the raw stream): the hooks read what they say.
    assert torch.allclose(ref[("mlp_in", 1)], ref[("post_attn", 1)]) == (family == "olmo2")


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_add_and_clamp_at_the_mlp_equal_hf_hooks(family, model_dirs, moe_dir):
    """An add at ``mlp_in`` (on prompt rows), a clamp and an add at ``mlp_out`` of other layers."""
    path = _path(family, model_dirs, moe_dir)
    llm = LLM(path, device="cpu", kv_cache_tokens=2048)
    hf = hf_model(path)
    prompt = SelectSpec(prompt="all")
    spec = SteeringSpec(interventions=[
        Add(0, _vec(1, 1.5), hook="mlp_in", select=prompt), Add(1, _vec(2, 1.0), hook="mlp_out"),
        Clamp(2, _vec(3, 1.0), hook="mlp_out", min=-0.2, max=0.2), Clamp(1, _vec(4, 1.0), hook="mlp_in", max=0.0)])
    edits = [("mlp_in", 0, add_edit(_vec(1, 1.5)), prompt), ("mlp_out", 1, add_edit(_vec(2, 1.0)), None),
             ("mlp_out", 2, clamp_edit(_vec(3, 1.0), -0.2, 0.2), None),
             ("mlp_in", 1, clamp_edit(_vec(4, 1.0), None, 0.0), None)]
    try:
        ids = llm.get_tokenizer()(PROMPTS[3]).input_ids
        params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, steering_vectors=spec)
        out = llm.generate([ids], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    tokens, logprobs = HFSteered(hf, edits).greedy(ids, N)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    plain_tokens, plain_logprobs = HFSteered(hf, []).greedy(ids, N)
    assert plain_tokens != tokens or (logprobs - plain_logprobs).abs().max() > 0.05, "steering must change the output"


def test_bad_mlp_hook_names_the_field(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=1024)
    with pytest.raises(ValueError, match=r"^steering_vectors\.interventions\[0\]\.hook: unknown hook 'mlp_mid'"):
        llm.generate("Hello", SamplingParams(max_tokens=1, steering_vectors=SteeringSpec(
            interventions=[Add(0, _vec(1, 1.0), hook="mlp_mid")])), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^capture\.hook: unknown hook 'mlp'"):
        llm.generate("Hello", SamplingParams(max_tokens=1, capture=CaptureSpec(hook="mlp")), use_tqdm=False)
    assert not llm.engine.requests
    assert llm.list_steerable_layers()["mlp_out"] == [0, 1, 2]
