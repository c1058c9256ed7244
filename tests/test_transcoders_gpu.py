"""GPU: transcoders with CUDA graphs on. In float32 their features, error node and steering equal
the reference math on HF tensors (decode steps replay graphs that hold the encoders, the error
group's accumulation and the transcoder clamps' reads and writes); in bfloat16 a mixed batch of
transcoder adds and clamps, Add / Clamp at mlp_in / mlp_out, feature and error captures gives the
same tokens and bit-identical captures with graphs as without."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PROMPTS, hf_model
from test_transcoders import (TOP_K, _active_feature, _capture, hf_points, reference_error, reference_features,
                              transcoders)
from hf_oracle import HFSteered, max_logprob_gap
from test_sae_capture import assert_features_match
from transcoder_helpers import feature_clamp_edits

from steerable import LLM, Add, Clamp, Feature, FeatureClamp, SamplingParams, SteeringSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _llm(path: str, device: str, **kw) -> LLM:
    llm = LLM(path, device=device, kv_cache_tokens=8192, **kw)
    for name, tc in transcoders().items():
        llm.register_sae(name, tc)
    return llm


def check_against_reference(capture_path: str, steer_path: str, device: str) -> list[LLM]:
    """Captures and steering on ``device`` (float32) against the reference math on HF's CPU tensors."""
    llm = _llm(capture_path, device, dtype="float32")
    hf = hf_model(capture_path)
    names = list(transcoders())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, capture=_capture(names))
    for out in llm.generate(PROMPTS[:4], params, use_tqdm=False):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        ref, rows = hf_points(hf, ids), slice(0, len(ids) - 1)
        for name in names:
            tc = llm.engine.saes.get(name)
            assert_features_match(out.captures["sae_features"][name], reference_features(tc, ref, rows, TOP_K))
            torch.testing.assert_close(out.captures["transcoder_error"][name].cpu(), reference_error(tc, ref, rows),
                                       atol=1e-4, rtol=1e-4)
    steer = _llm(steer_path, device, dtype="float32")
    hf = hf_model(steer_path)
    ids = steer.get_tokenizer()(PROMPTS[5]).input_ids
    plt, clt = _active_feature(steer, hf, "plt", ids, 1), _active_feature(steer, hf, "clt", ids, 0)
    spec = SteeringSpec(features=[FeatureClamp("plt", plt), FeatureClamp("clt", clt, value=4.0),
                                  Feature("clt", 7, scale=2.0)])
    edits = [*feature_clamp_edits(steer.engine.saes.get("plt"), plt, 0.0),
             *feature_clamp_edits(steer.engine.saes.get("clt"), clt, 4.0),
             *[("mlp_out", layer, lambda h, row=row: h + 2.0 * row, None)
               for layer, row in steer.engine.saes.get("clt").decoder_rows(7)]]
    out = steer.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5,
                                               steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(ids, 8)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    return [llm, steer]


def test_transcoders_on_gpu_equal_reference_math(capture_dirs, model_dirs):
    engines = check_against_reference(capture_dirs["qwen3"], model_dirs["qwen3"], "cuda")
    assert all(llm.llm_engine.stats()["graph_replays"] > 0 for llm in engines)


def mixed_batch(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """24 requests: transcoder adds and clamps (per-layer, cross-layer, a set), Add / Clamp at the
    MLP's points, feature and error captures, unsteered ones."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(5, 60))] for _ in range(24)]
    v = [(torch.randn(64, generator=torch.Generator().manual_seed(100 + i)) * 2).tolist() for i in range(4)]
    params = []
    for i in range(24):
        kw = dict(max_tokens=20, temperature=0, ignore_eos=True)
        kind = i % 4
        if kind == 0:
            kw["steering_vectors"] = SteeringSpec(features=[FeatureClamp("clt", i, value=3.0), Feature("plt", i)])
        elif kind == 1:
            kw["steering_vectors"] = SteeringSpec(
                interventions=[Add(1, v[0], hook="mlp_in"), Clamp(2, v[1], hook="mlp_out", min=-0.5, max=0.5)],
                features=[FeatureClamp("set", 48 + i, value=2.0), FeatureClamp("plt", i + 1)])
        elif kind == 2:
            kw["steering_vectors"] = SteeringSpec(features=[Feature("clt", 48 * (i % 3) + i, scale=-2.0)])
        if i % 3 == 0:
            kw["capture"] = _capture(["plt", "clt"], "all_generated")
        params.append(SamplingParams(**kw))
    return prompts, params


def run_batch(path: str, device: str, eager: bool):
    llm = _llm(path, device, dtype="bfloat16" if device == "cuda" else "float32", enforce_eager=eager)
    prompts, params = mixed_batch()
    return llm.generate(prompts, params, use_tqdm=False), llm.capture_status("sae_features")


def test_transcoder_graph_replay_is_bit_identical_to_eager(model_dirs):
    (eager, _), (graphed, status) = run_batch(model_dirs["qwen3"], "cuda", True), run_batch(
        model_dirs["qwen3"], "cuda", False)
    assert status["graph_replays"] > 0
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for component, tensors in a.captures.items():
            for name, rows in tensors.items():
                other = b.captures[component][name]
                assert rows == other if component == "sae_features" else torch.equal(rows, other)
    assert sum("transcoder_error" in out.captures for out in eager) == 8
