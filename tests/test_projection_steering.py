"""Projection scaling and projection caps as steering forms of their own: ``Clamp(factor=c)``
(Neuronpedia's ORTHOGONAL_DECOMP, ``h + (c - 1)(h·u) u``) and ``Clamp(max=c)`` (its PROJECTION_CAP,
``h + (min(h·u, c) - h·u) u``) equal those formulas applied by an HF hook, greedy tokens identical;
``factor=1`` keeps every older clamp's identity (digest, wire form); the wire carries ``factor``
and bad values are refused naming it."""

import math
import os

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import check_steered_greedy

from steerable import LLM, Clamp, SamplingParams, SteeringSpec
from steerable.steering.spec import SpecParser, _layer_digest, _vector_hash
from steerable.steering.wire import spec_from_dict, spec_to_dict, steering_from_json

N = 10
FUSED_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and \
    os.environ.get("STEERABLE_FUSED_ON_CPU") == "1"


def greedy(**kw):
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


def unit(seed: int, size: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(size, generator=g)
    return d / d.norm()


def orthogonal_decomp(u: torch.Tensor, c: float):
    """The reference server's ORTHOGONAL_DECOMP: ``(I - P) h + c P h`` with ``P = u u^T``."""
    def fn(h: torch.Tensor) -> torch.Tensor:
        along = (h @ u).unsqueeze(-1) * u
        return (h - along) + c * along
    return fn


def projection_cap(u: torch.Tensor, c: float):
    """PROJECTION_CAP as the issue (and the reference's vLLM path) states it."""
    def fn(h: torch.Tensor) -> torch.Tensor:
        p = h @ u
        return h + (torch.clamp(p, max=c) - p).unsqueeze(-1) * u
    return fn


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2"])
def family(request, model_dirs):
    path = model_dirs[request.param]
    return LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)


def _check(llm, hf, spec, edits):
    check_steered_greedy(llm, hf, llm.get_tokenizer()(PROMPTS[1]).input_ids, spec, edits, N)


@pytest.mark.parametrize("hook", ["pre_attn", "post_mlp"])
@pytest.mark.parametrize("c", [0.0, -2.0, 4.0])
def test_factor_is_orthogonal_decomposition(family, hook, c):
    llm, hf = family
    u = unit(1)
    direction = u * 7.0  # any length: the clamp reads the unit direction
    _check(llm, hf, SteeringSpec(clamps=[Clamp(1, direction, hook=hook, factor=c)]),
           [(hook, 1, orthogonal_decomp(u, c), None)])


@pytest.mark.parametrize("c", [-1.0, 0.5])
def test_max_alone_is_projection_cap(family, c):
    llm, hf = family
    u = unit(2)
    _check(llm, hf, SteeringSpec(clamps=[Clamp(2, u, hook="post_attn", max=c)]),
           [("post_attn", 2, projection_cap(u, c), None)])


def test_factor_then_bounds_and_several_slots_in_order(family):
    """``clip(factor * p, min, max)`` with a partial strength, then a second slot at the same site
    reading what the first wrote."""
    llm, hf = family
    u, w = unit(3), unit(4)

    def first(h):
        p = h @ u
        return h + (0.5 * ((3.0 * p).clamp(-1.0, 2.0) - p)).unsqueeze(-1) * u

    spec = SteeringSpec(clamps=[Clamp(1, u, min=-1.0, max=2.0, strength=0.5, factor=3.0), Clamp(1, w, factor=-1.0)])
    _check(llm, hf, spec, [("post_mlp", 1, first, None), ("post_mlp", 1, orthogonal_decomp(w, -1.0), None)])


def test_factor_one_keeps_the_clamp_identity_and_wire():
    """A clamp without a factor hashes as it did before factors existed (its prefix-cache blocks
    and steering rows stay shared), and its wire form has no ``factor`` key."""
    parser = SpecParser(8, 3)
    d = [1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    plain, = parser.parse([Clamp(1, d, max=0.5)], "s")
    unit_d = torch.tensor(d) / math.sqrt(5.0)
    head = f"clamp|post_mlp|{-math.inf}|0.5|1.0|*|".encode()  # the digest's layout before factors
    assert plain.digest == _layer_digest(head + _vector_hash(unit_d), 1)
    scaled, = parser.parse([Clamp(1, d, max=0.5, factor=2.0)], "s")
    assert scaled.digest != plain.digest and scaled.factor == 2.0
    assert "factor" not in spec_to_dict(SteeringSpec(clamps=[Clamp(1, d, max=0.5)]))["clamps"][0]
    wire = spec_to_dict(SteeringSpec(interventions=[Clamp(1, d, factor=-0.5)]))
    assert wire["interventions"][0]["factor"] == -0.5
    back = spec_from_dict(wire)
    assert back.interventions[0].factor == -0.5
    assert parser.parse(back, "s")[0].digest == parser.parse([Clamp(1, d, factor=-0.5)], "s")[0].digest


def test_module_with_a_factor_round_trips(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    llm.register_steering_modules({"decomp": SteeringSpec(clamps=[Clamp(1, unit(5), factor=0.25)])})
    got = llm.get_steering_module("decomp").interventions[0]
    assert isinstance(got, Clamp) and got.factor == 0.25
    ids = llm.get_tokenizer()(PROMPTS[0]).input_ids
    by_ref = llm.generate([ids], greedy(steering_module_ref="decomp"), use_tqdm=False)[0].outputs[0]
    inline = llm.generate([ids], greedy(steering_vectors=SteeringSpec(clamps=[Clamp(1, unit(5), factor=0.25)])),
                          use_tqdm=False)[0].outputs[0]
    assert by_ref.token_ids == inline.token_ids


def test_the_wire_carries_both_forms_to_a_server(http, offline):
    """``{"type": "clamp", "factor": c}`` and ``"max": c`` in ``steering_vectors`` over HTTP equal
    the offline engine with the same spec (the shared test server serves the tiny Qwen3)."""
    from server_harness import SERVED_NAME, USER

    d = unit(10).tolist()
    wire = {"clamps": [{"layer": 1, "direction": d, "factor": -2.0}, {"layer": 2, "direction": d, "max": -1.0}]}
    body = {"model": SERVED_NAME, "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = http.post("/v1/completions", headers=USER, json={**body, "steering_vectors": wire})
    assert r.status_code == 200, r.text
    plain = http.post("/v1/completions", headers=USER, json=body).json()["choices"][0]["token_ids"]
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, steering_vectors=steering_from_json(wire))
    want = offline.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert r.json()["choices"][0]["token_ids"] == want != plain
    bad = http.post("/v1/completions", headers=USER, json={**body, "steering_vectors": {
        "clamps": [{"layer": 1, "direction": d, "factor": "x"}]}})
    assert bad.status_code == 400 and "factor" in bad.json()["error"]["message"]


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), "2"])
def test_bad_factor_is_refused_naming_it(model_dirs, factor):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match="factor"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, steering_vectors=SteeringSpec(
            clamps=[Clamp(1, unit(6), factor=factor)])), use_tqdm=False)
    assert llm.get_steering_status()["rows_in_use"] == 0


def _fused_or_gpu(llm, hf, tolerance):
    """Both forms and a bounded factor at one site (the fused norm) and alone (the standalone kernel)."""
    u, w, x = unit(7), unit(8), unit(9)
    spec = SteeringSpec(clamps=[Clamp(1, u, hook="post_attn", factor=-1.0), Clamp(1, w, hook="post_attn", max=0.2),
                                Clamp(2, x, hook="pre_attn", min=-0.5, max=0.5, factor=4.0)])
    edits = [("post_attn", 1, orthogonal_decomp(u, -1.0), None), ("post_attn", 1, projection_cap(w, 0.2), None),
             ("pre_attn", 2, lambda h: h + ((4.0 * (h @ x)).clamp(-0.5, 0.5) - h @ x).unsqueeze(-1) * x, None)]
    check_steered_greedy(llm, hf, llm.get_tokenizer()(PROMPTS[3]).input_ids, spec, edits, N, tolerance)


@pytest.mark.triton
@pytest.mark.skipif(not FUSED_ON_CPU, reason="run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1")
def test_projection_forms_on_the_fused_path(capture_dirs):
    path = capture_dirs["qwen3"]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=8)
    _fused_or_gpu(llm, hf_model(path), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_projection_forms_on_gpu(capture_dirs):
    path = capture_dirs["qwen3"]
    _fused_or_gpu(LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192), hf_model(path), 1e-3)
