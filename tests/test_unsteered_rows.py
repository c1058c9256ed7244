"""Isolation, bit for bit: an unsteered request beside steered ones (SAE features and transcoder
features, adds and clamps, vectors at every point, LoReFT, affine and conditional edits) gets the logprobs it gets in the same batch
with no steering at all, on each family's residual layout (parallel-residual GPT-NeoX included,
where ``post_attn`` is not on the stream's own path); capturing there changes no output either.
The comparison is with the same batch unsteered, not with the request alone: a CPU GEMM rounds by
the number of rows it multiplies, with or without steering (docs/steering.md, batch invariance)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, max_logprob_gap
from test_sae_registry import random_sae
from transcoder_helpers import feature_clamp_edits, random_transcoder

from steerable import (LLM, Add, Affine, CaptureSpec, Clamp, Feature, FeatureClamp, LowRank, SamplingParams, SelectSpec,
                       SteeringSpec, When)

N = 6
HOOKS = ("pre_attn", "post_attn", "post_mlp", "mlp_in", "mlp_out")
SAES = ("sae_pre_attn", "sae_post_attn", "sae_post_mlp", "plt", "clt")


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=3, **kw)


def _logprobs(out) -> list[dict[int, float]]:
    return [{token: lp.logprob for token, lp in step.items()} for step in out.outputs[0].logprobs]


def _register(llm: LLM) -> None:
    hidden = llm.llm_engine.model_config.hidden_size
    for i, hook in enumerate(("pre_attn", "post_attn", "post_mlp")):
        llm.register_sae(f"sae_{hook}", random_sae(d_in=hidden, layer=1, hook=hook, seed=i))
    llm.register_sae("plt", random_transcoder(layer=1, skip=True, seed=1, d=hidden))  # reads mlp_in
    # A cross-layer transcoder reading the residual after attention (circuit-tracer's hook_resid_mid)
    llm.register_sae("clt", random_transcoder(layers=3, layer=0, cross_layer=True, hook="post_attn", seed=3,
                                              d=hidden))


@pytest.fixture(scope="module", params=["llama", "gemma3", "gpt2", "gpt_neox"])
def engine(request, model_dirs):
    # A small token budget: the unsteered prompt's chunks share steps with steered ones.
    llm = LLM(model_dirs[request.param], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False,
              max_num_batched_tokens=24)
    _register(llm)
    yield request.param, llm
    llm.shutdown()


def _companions(hidden: int, saes: tuple[str, ...], hooks: tuple[str, ...], edits: bool) -> list[SteeringSpec]:
    """One config per companion: every kind of feature item of each of ``saes``, prompt-only and
    decode-only among them, vectors at each of ``hooks``, and (``edits``) the matrix edits."""
    g = torch.Generator().manual_seed(0)
    specs = []
    for name in saes:
        specs.append(SteeringSpec(features=[Feature(name, 3, scale=4.0)]))
        specs.append(SteeringSpec(features=[FeatureClamp(name, 5, value=2.0, select=SelectSpec(prompt="all"))]))
        specs.append(SteeringSpec(features=[FeatureClamp(name, 7, value=1.5, select=SelectSpec(generation="all"))]))
    for hook in hooks:
        specs.append(SteeringSpec(interventions=[Add(1, torch.randn(hidden, generator=g), hook=hook),
                                                 Clamp(1, torch.randn(hidden, generator=g), hook=hook, min=-0.5,
                                                       max=0.5)]))
    if edits:  # LoReFT, a dense affine edit and conditional steering: matrix products per row
        R = torch.linalg.qr(torch.randn(hidden, 2, generator=g))[0].T.contiguous()
        specs.append(SteeringSpec(interventions=[LowRank(1, R, torch.randn(2, hidden, generator=g),
                                                         torch.randn(2, generator=g), hook="post_attn")]))
        specs.append(SteeringSpec(interventions=[Affine(1, torch.randn(hidden, hidden, generator=g) * 0.1,
                                                        hook="mlp_out")]))
        specs.append(SteeringSpec(interventions=[When([Add(2, torch.randn(hidden, generator=g) * 4)], layer=1,
                                                      direction=torch.randn(hidden, generator=g))]))
    return specs


def assert_unsteered_row_unchanged(llm: LLM, saes: tuple[str, ...] = SAES, hooks: tuple[str, ...] = HOOKS,
                                   edits: bool = True) -> None:
    """The first request, unsteered, beside one companion per kind of steering: its logprobs
    equal those of the same batch run without steering, and every companion's steering acts."""
    companions = _companions(llm.llm_engine.model_config.hidden_size, saes, hooks, edits)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(companions) + 1)]
    plain = llm.generate(prompts, greedy(), use_tqdm=False)
    mixed = llm.generate(prompts, [greedy()] + [greedy(steering_vectors=s) for s in companions], use_tqdm=False)
    assert _logprobs(mixed[0]) == _logprobs(plain[0])
    unchanged = [s for s, m, p in zip(companions, mixed[1:], plain[1:]) if _logprobs(m) == _logprobs(p)]
    assert not unchanged, f"every companion's steering must act (effect-size check): {unchanged}"
    assert llm.get_steering_status()["rows_in_use"] == 0


def test_unsteered_row_is_byte_identical_beside_every_kind_of_steering(engine):
    assert_unsteered_row_unchanged(engine[1])


@pytest.mark.triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or os.environ.get("STEERABLE_FUSED_ON_CPU")
                    != "1", reason="run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1")
def test_unsteered_row_is_byte_identical_in_the_fused_kernels(model_dirs):
    """The GPU path's fused add + steering + norm kernels (feature clamps read one direction and
    write another in them) and the standalone steering kernel (a transcoder's writes at mlp_out),
    under Triton's CPU interpreter (a few of the kinds: each request costs seconds there)."""
    llm = LLM(model_dirs["llama"], device="cpu", dtype="float32", kv_cache_tokens=2048, attention_backend="triton",
              enable_prefix_caching=False, max_num_batched_tokens=24)
    _register(llm)
    assert_unsteered_row_unchanged(llm, saes=("sae_post_attn", "clt"), hooks=("post_mlp",), edits=False)
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_unsteered_row_is_byte_identical_on_gpu(model_dirs, family, dtype):
    """On a GPU, with CUDA graphs and the fused kernels, in float32 and bfloat16."""
    llm = LLM(model_dirs[family], device="cuda", dtype=dtype, kv_cache_tokens=4096, enable_prefix_caching=False,
              max_num_batched_tokens=24)
    _register(llm)
    assert_unsteered_row_unchanged(llm)
    llm.shutdown()


def test_capture_at_any_point_changes_no_output(engine):
    _, llm = engine
    prompts = PROMPTS[:3]
    plain = llm.generate(prompts, greedy(), use_tqdm=False)
    captured = llm.generate(prompts, greedy(capture=[CaptureSpec(hook=hook, layers=[1]) for hook in ("post_attn",)]
                                        + [CaptureSpec(stream="sae_features", saes=["clt", "sae_post_attn"])]),
                            use_tqdm=False)
    for c, p in zip(captured, plain):
        assert _logprobs(c) == _logprobs(p)
        assert c.captures["hidden_states"][1].shape[0] > 0


def test_parallel_residual_transcoder_clamp_reading_post_attn_matches_hf(engine, model_dirs):
    """GPT-NeoX's parallel residual forms ``post_attn`` off the stream's path: a cross-layer
    transcoder reading it clamps and writes at ``mlp_out`` as HF hooks do."""
    family, llm = engine
    if family != "gpt_neox":
        pytest.skip("the parallel-residual layout")
    hf = hf_model(model_dirs[family])
    clt = llm.llm_engine.saes.get("clt")
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    spec = SteeringSpec(features=[FeatureClamp("clt", 4, value=3.0)])
    out = llm.generate([ids], greedy(steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, feature_clamp_edits(clt, 4, 3.0)).greedy(ids, N)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    plain_tokens, plain_logprobs = HFSteered(hf, []).greedy(ids, N)
    assert plain_tokens != tokens or (logprobs - plain_logprobs).abs().max() > 0.05, "the clamp must act"
