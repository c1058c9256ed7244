"""Steering by SAE feature: ``Feature`` equals an HF hook adding ``scale * W_dec[i]``, ``FeatureClamp``
an HF hook applying ``h += (value - a_i(h)) * W_dec[i]`` to every selected row; isolation in a mixed
batch, modules / global / JSON forms, prefix-cache identity, bad input and unregistering in use."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, max_logprob_gap
from test_sae_registry import random_sae, save_saelens

from steerable import LLM, SAE, Feature, FeatureClamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.errors import InvalidRequestError
from steerable.steering.wire import steering_from_json

N = 8
FAMILIES = ["llama", "qwen3", "gemma3"]
# One SAE of each architecture, each at its own residual point.
SAES = {"res1": dict(architecture="jumprelu", layer=1, hook="post_mlp", apply_b_dec_to_input=True, seed=1),
        "mid0": dict(architecture="topk", layer=0, hook="post_attn", seed=2),
        "pre2": dict(architecture="relu", layer=2, hook="pre_attn", apply_b_dec_to_input=True, seed=3)}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    saes = {name: random_sae(**kw) for name, kw in SAES.items()}
    for name, sae in saes.items():
        llm.register_sae(name, sae)
    yield llm, hf_model(path), saes
    llm.shutdown()


def _ids(llm, text):
    return llm.get_tokenizer()(text).input_ids


def feature_clamp_edit(sae: SAE, index: int, value: float, strength: float = 1.0):
    """The issue's formula on the rows an HF hook sees: ``a`` is the SAE's activation of the feature
    (jumprelu: gated by its threshold; relu and topk: the relu'd pre-activation)."""
    w = sae.W_dec[index].float()

    def fn(h: torch.Tensor) -> torch.Tensor:
        pre = sae.pre_activations(h)[..., index]
        a = (pre * (pre > sae.threshold[index].float())).relu() if sae.architecture == "jumprelu" else pre.relu()
        return h + (strength * (value - a)).unsqueeze(-1) * w
    return fn


def _check(llm, hf, prompt_ids, steering, edits):
    out = llm.generate([prompt_ids], greedy(steering_vectors=steering), use_tqdm=False)[0]
    ref_tokens, ref_lp = HFSteered(hf, edits).greedy(prompt_ids, N)
    assert out.outputs[0].token_ids == ref_tokens
    assert max_logprob_gap(out, ref_lp) <= 1e-4
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(prompt_ids, N)
    effect = (ref_lp - plain_lp).abs().max().item()
    assert plain_tokens != ref_tokens or effect > 0.05, "steering must change the output (effect-size check)"
    return out


def test_feature_adds_match_hf_hooks(family):
    llm, hf, saes = family
    spec = SteeringSpec(features=[Feature("res1", 5, scale=3.0), Feature("mid0", 17, scale=-2.0),
                                  Feature("pre2", 40, scale=2.5, select=SelectSpec(generation="all"))])
    edits = [("post_mlp", 1, add_edit(3.0 * saes["res1"].W_dec[5]), None),
             ("post_attn", 0, add_edit(-2.0 * saes["mid0"].W_dec[17]), None),
             ("pre_attn", 2, add_edit(2.5 * saes["pre2"].W_dec[40]), SelectSpec(generation="all"))]
    _check(llm, hf, _ids(llm, PROMPTS[1]), spec, edits)


def test_feature_clamps_match_hf_hooks(family):
    """Clamps of each architecture (one an ablation, one on prompt rows only, one at half strength)
    composed with an add at the same point, which comes first as for projection clamps."""
    llm, hf, saes = family
    prompt = SelectSpec(prompt="all")
    spec = SteeringSpec(features=[Feature("res1", 3, scale=2.0), FeatureClamp("res1", 3, value=4.0),
                                  FeatureClamp("mid0", 9, value=0.0), FeatureClamp("mid0", 10, value=-3.0),
                                  FeatureClamp("pre2", 60, value=5.0, select=prompt, strength=0.5)])
    edits = [("post_mlp", 1, add_edit(2.0 * saes["res1"].W_dec[3]), None),
             ("post_mlp", 1, feature_clamp_edit(saes["res1"], 3, 4.0), None),
             ("post_attn", 0, feature_clamp_edit(saes["mid0"], 9, 0.0), None),
             ("post_attn", 0, feature_clamp_edit(saes["mid0"], 10, -3.0), None),
             ("pre_attn", 2, feature_clamp_edit(saes["pre2"], 60, 5.0, 0.5), prompt)]
    _check(llm, hf, _ids(llm, PROMPTS[3]), spec, edits)


def test_ablation_of_an_active_feature(family):
    """``FeatureClamp(value=0)`` of the feature active on most rows removes ``a * W_dec[i]`` from each
    of them (the feature's share of the SAE's reconstruction)."""
    llm, hf, saes = family
    sae, ids = saes["res1"], _ids(llm, PROMPTS[5])
    captured: dict = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(ids), captured)
    acts = sae.encode(captured[("post_mlp", 1)])
    index = int((acts > 0).sum(0).argmax())
    assert (acts[:, index] > 0).sum() >= 2
    _check(llm, hf, ids, SteeringSpec(features=[FeatureClamp("res1", index)]),
           [("post_mlp", 1, feature_clamp_edit(sae, index, 0.0), None)])


def test_unsteered_request_in_a_mixed_batch_is_byte_identical(model_dirs):
    """Feature-steered neighbours leave an unsteered request bit for bit as in the same batch run
    without any steering (and its tokens as when it runs alone)."""
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False)
    llm.register_sae("res1", random_sae(**SAES["res1"]))
    prompts = PROMPTS[:4]
    alone = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0]
    plain = llm.generate(prompts, greedy(), use_tqdm=False)
    steered = [greedy(steering_vectors=SteeringSpec(features=[Feature("res1", i, scale=3.0),
                                                              FeatureClamp("res1", i + 1, value=2.0)]))
               for i in range(3)]
    mixed = llm.generate(prompts, [greedy()] + steered, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[0].outputs[0].logprobs == plain[0].outputs[0].logprobs
    assert any(m.outputs[0].token_ids != p.outputs[0].token_ids for m, p in zip(mixed[1:], plain[1:]))
    assert llm.get_steering_status()["rows_in_use"] == 0  # every row was freed
    llm.shutdown()


def test_module_global_and_json_forms_equal_inline(family):
    llm, _, _ = family
    items = [Feature("res1", 5, scale=3.0), FeatureClamp("mid0", 9, value=1.5, select=SelectSpec(prompt="all"))]
    spec = SteeringSpec(features=items)
    ids = _ids(llm, PROMPTS[0])
    inline = llm.generate([ids], greedy(steering_vectors=spec), use_tqdm=False)[0].outputs[0]
    wire = {"features": [{"sae": "res1", "index": 5, "scale": 3.0},
                         {"sae": "mid0", "index": 9, "value": 1.5, "clamp": True, "select": "all_prompt"}]}
    assert SteeringSpec.from_dict(spec.to_dict()) == spec
    as_json = llm.generate([ids], greedy(steering_vectors=steering_from_json(wire)), use_tqdm=False)[0].outputs[0]
    llm.register_steering_modules({"feat": spec})
    assert llm.get_steering_module("feat").interventions[1] == FeatureClamp("mid0", 9, 1.5, SelectSpec(prompt="all"))
    module = llm.generate([ids], greedy(steering_module_ref="feat"), use_tqdm=False)[0].outputs[0]
    llm.set_steering_vectors(spec)
    glob = llm.generate([ids], greedy(), use_tqdm=False)[0].outputs[0]
    with pytest.raises(InvalidRequestError, match="global steering, steering module 'feat'"):
        llm.unregister_sae("res1")
    llm.clear_steering_vectors()
    llm.unregister_steering_modules(["feat"])
    for other in (as_json, module, glob):
        assert other.token_ids == inline.token_ids and other.logprobs == inline.logprobs
    also = llm.generate([ids], greedy(steering_vectors=items), use_tqdm=False)[0].outputs[0]  # a bare item list
    assert also.logprobs == inline.logprobs


def test_prefix_cache_keys_name_the_sae_content(model_dirs):
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    llm.register_sae("a", random_sae(seed=5))
    prompt = PROMPTS[3]  # several blocks long

    def hits(spec) -> int:
        before = llm.engine.kv.hit_tokens
        llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)
        return llm.engine.kv.hit_tokens - before

    first = SteeringSpec(features=[Feature("a", 3, scale=2.0)])
    assert hits(first) == 0
    assert hits(first) > 0  # the same feature steering shares its blocks
    assert hits(SteeringSpec(features=[Feature("a", 3, scale=2.5)])) == 0  # another scale
    assert hits(SteeringSpec(features=[Feature("a", 4, scale=2.0)])) == 0  # another feature
    clamp = SteeringSpec(features=[FeatureClamp("a", 3, value=1.0)])
    assert hits(clamp) == 0 and hits(clamp) > 0
    assert hits(SteeringSpec(features=[FeatureClamp("a", 3, value=2.0)])) == 0  # another value
    llm.unregister_sae("a")
    llm.register_sae("a", random_sae(seed=6))  # the same name, other weights
    assert hits(first) == 0
    decode_only = SteeringSpec(features=[Feature("a", 3, scale=2.0, select=SelectSpec(generation="all"))])
    hits(None)
    assert hits(decode_only) > 0  # decode-only steering keeps the unsteered prompt blocks shareable
    llm.shutdown()


@pytest.fixture(scope="module")
def shared(model_dirs):
    """One engine for the bad-input cases and the live-request refusal."""
    with LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=2048) as llm:
        llm.register_sae("res1", random_sae(**SAES["res1"]))
        yield llm


@pytest.mark.parametrize("steering, field", [
    (SteeringSpec(features=[Feature("nope", 1)]), "steering_vectors.features[0].sae"),
    (SteeringSpec(features=[Feature("res1", 96)]), "steering_vectors.features[0].index"),
    (SteeringSpec(features=[FeatureClamp("res1", -1)]), "steering_vectors.features[0].index"),
    (SteeringSpec(features=[Feature("res1", 1, scale=float("nan"))]), "steering_vectors.features[0].scale"),
    (SteeringSpec(features=[FeatureClamp("res1", 1, strength=2.0)]), "steering_vectors.features[0].strength"),
    (SteeringSpec(interventions=[Feature("res1", True)]), "steering_vectors.interventions[0].index"),
    ({"features": [{"sae": "res1", "index": 1, "value": 0.0}]}, "steering_vectors.features[0].value"),
    ({"features": [{"sae": "res1", "index": 1, "scale": 1.0, "clamp": True}]}, "steering_vectors.features[0].scale"),
    ({"features": [{"sae": "res1"}]}, "steering_vectors.features[0]: missing"),
    ({"features": [{"sae": "res1", "index": 1, "scael": 1.0}]}, "steering_vectors.features[0].scael"),
])
def test_bad_feature_steering_is_refused_and_leaks_nothing(shared, steering, field):
    llm = shared
    with pytest.raises(InvalidRequestError) as err:
        if isinstance(steering, dict):
            steering = steering_from_json(steering)
        llm.generate(["Hello"], greedy(steering_vectors=steering), use_tqdm=False)
    assert str(err.value).startswith(field), str(err.value)
    status = llm.get_steering_status()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0 and not llm.engine.requests
    assert len(llm.generate(["Hello"], greedy(), use_tqdm=False)[0].outputs[0].token_ids) == N


def test_unregister_is_refused_while_a_live_request_uses_the_sae(shared):
    llm = shared
    llm.register_sae("live", random_sae(seed=9))
    engine = llm.engine
    engine.add_request("r1", "Hello world", greedy(steering_vectors=SteeringSpec(features=[Feature("live", 2)])))
    engine.step()
    with pytest.raises(InvalidRequestError, match=r"^name: SAE 'live' is in use by 1 live request"):
        llm.unregister_sae("live")
    while engine.has_unfinished_requests():
        engine.step()
    llm.unregister_sae("live")
    assert "live" not in llm.list_saes()


def test_feature_steering_over_http_equals_offline(server, http, offline, tmp_path):
    """An SAE registered from its files on the server (``POST /v1/saes``) steers a request by
    feature exactly as the same SAE does offline; a bad feature is a 400 naming the field."""
    import uuid

    from server_harness import ADMIN, SERVED_NAME, USER

    save_saelens(random_sae(**SAES["res1"]), tmp_path)
    assert http.post("/v1/saes", json={"feat": {"path": str(tmp_path)}}, headers=ADMIN).status_code == 200
    offline.register_sae("feat", SAE.load(str(tmp_path)))
    wire = {"features": [{"sae": "feat", "index": 5, "scale": 3.0},
                         {"sae": "feat", "index": 9, "value": 2.0, "clamp": True, "select": "all_generated"}]}
    try:
        salt = uuid.uuid4().hex
        r = http.post("/v1/completions", headers=USER, json={
            "model": SERVED_NAME, "prompt": PROMPTS[1], "max_tokens": N, "temperature": 0, "logprobs": 1,
            "steering_vectors": wire, "return_token_ids": True, "cache_salt": salt}).json()
        ref = offline.generate(PROMPTS[1], greedy(steering_vectors=steering_from_json(wire), cache_salt=salt),
                               use_tqdm=False)[0].outputs[0]
        plain = offline.generate(PROMPTS[1], greedy(), use_tqdm=False)[0].outputs[0]
        choice = r["choices"][0]
        assert choice["token_ids"] == ref.token_ids != plain.token_ids
        assert choice["logprobs"]["token_logprobs"] == [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
        bad = http.post("/v1/completions", headers=USER, json={
            "model": SERVED_NAME, "prompt": "x", "max_tokens": 1,
            "steering_vectors": {"features": [{"sae": "feat", "index": 96}]}})
        assert bad.status_code == 400 and "steering_vectors.features[0].index" in bad.text
    finally:
        assert http.delete("/v1/saes/feat", headers=ADMIN).status_code == 200
        offline.unregister_sae("feat")
