"""Transcoders in the engine, judged by the reference math on HF tensors read by hooks on the MLP:
their top features (``sae_features``), their error node (``transcoder_error``: the MLP's output
minus the reconstruction, skip term included), ``Feature`` adds at ``mlp_out`` (a cross-layer
feature at every layer it decodes to) and ``FeatureClamp`` (read where the transcoder reads, written
at every decoded layer), for a per-layer transcoder with a skip term, a set of per-layer
transcoders and a cross-layer transcoder reading the residual (circuit-tracer's ``hook_resid_mid``);
under chunked prefill, prefix caching and preemption; bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, max_logprob_gap
from test_mlp_points import moe_dir  # noqa: F401 (fixture)
from test_sae_capture import assert_features_match
from transcoder_helpers import activation, feature_clamp_edits, random_transcoder

from steerable import LLM, CaptureSpec, Feature, FeatureClamp, SamplingParams, SelectSpec, SteeringSpec, Transcoder
from steerable.capture.sparse import SparseFeatures

TOP_K = 8
N = 6
FAMILIES = ["llama", "qwen3", "gemma3", "qwen3_moe"]


def transcoders() -> dict[str, Transcoder]:
    return {"plt": random_transcoder(layer=1, skip=True, seed=1),
            "set": random_transcoder(layers=3, layer=0, architecture="relu", seed=2),
            "clt": random_transcoder(layers=3, layer=0, cross_layer=True, hook="post_attn", seed=3),
            "topk": random_transcoder(layer=2, architecture="topk", k=4, seed=4)}


def _llm(path: str, **kw) -> LLM:
    llm = LLM(path, device="cpu", kv_cache_tokens=kw.pop("kv_cache_tokens", 4096), **kw)
    for name, tc in transcoders().items():
        llm.register_sae(name, tc)
    return llm


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, capture_dirs, moe_dir):  # noqa: F811
    path = moe_dir if request.param == "qwen3_moe" else capture_dirs[request.param]
    llm = _llm(path)
    yield llm, hf_model(path)
    llm.shutdown()


def hf_points(hf, ids: list[int]) -> dict:
    captured: dict = {}
    HFSteered(hf, []).forward(torch.tensor([ids]), len(ids), captured)
    return captured


def inputs(tc: Transcoder, ref: dict, rows) -> list[torch.Tensor]:
    return [ref[(tc.hook, layer)][rows] for layer in tc.layers]


def reference_features(tc: Transcoder, ref: dict, rows, top_k: int) -> SparseFeatures:
    acts = torch.cat([tc.encode(x, layer) for x, layer in zip(inputs(tc, ref, rows), tc.layers)], dim=-1)
    values, indices = torch.sort(acts, dim=-1, descending=True, stable=True)
    values, indices = values[:, :top_k], indices[:, :top_k]
    return SparseFeatures(torch.where(values > 0, indices, -1).int(), torch.where(values > 0, values, 0.0))


def reference_error(tc: Transcoder, ref: dict, rows) -> torch.Tensor:
    outputs = [ref[("mlp_out", layer)][rows] for layer in tc.layers]
    errors = torch.stack(tc.error(inputs(tc, ref, rows), outputs), dim=1)
    return errors[:, 0] if tc.n_sources == 1 else errors


def _capture(names, select="all") -> list[CaptureSpec]:
    return [CaptureSpec(stream="sae_features", saes=names, top_k=TOP_K, select=select),
            CaptureSpec(stream="transcoder_error", saes=names, select=select)]


def test_features_and_error_node_equal_reference_math(family):
    llm, hf = family
    names = list(transcoders())
    tcs = {name: llm.engine.saes.get(name) for name in names}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, capture=_capture(names))
    for out in llm.generate(PROMPTS[:3], params, use_tqdm=False):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        ref = hf_points(hf, ids)
        rows = slice(0, len(ids) - 1)
        for name, tc in tcs.items():
            meta = out.capture_meta["sae_features"][name]
            assert meta.positions.tolist() == list(range(len(ids) - 1)) and meta.token_ids.tolist() == ids[:-1]
            assert_features_match(out.captures["sae_features"][name], reference_features(tc, ref, rows, TOP_K))
            error = out.captures["transcoder_error"][name]
            expected = reference_error(tc, ref, rows)
            assert error.dtype == torch.float32 and error.shape == expected.shape
            torch.testing.assert_close(error, expected, atol=1e-4, rtol=1e-4)
            assert out.capture_meta["transcoder_error"][name].positions.tolist() == meta.positions.tolist()
    clt = out.captures["sae_features"]["clt"].indices  # a cross-layer row's features come from several layers
    assert len(set((clt[clt >= 0] // tcs["clt"].d_transcoder).tolist())) > 1
    assert (out.captures["sae_features"]["topk"].indices[:, 4:] == -1).all()


def test_error_node_of_a_reduced_budget_capture(family):
    llm, hf = family
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=CaptureSpec(
        stream="transcoder_error", saes=["plt", "clt"], select=SelectSpec(prompt_positions=[-1], generation="all"),
        budget_rows=2))
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    P = len(out.prompt_token_ids)
    ref = hf_points(hf, out.prompt_token_ids + out.outputs[0].token_ids)
    for name in ("plt", "clt"):
        assert out.capture_meta["transcoder_error"][name].positions.tolist() == [P - 1, P]
        torch.testing.assert_close(out.captures["transcoder_error"][name],
                                   reference_error(llm.engine.saes.get(name), ref, [P - 1, P]), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- steering


@pytest.fixture(scope="module", params=FAMILIES)
def steered(request, model_dirs, moe_dir):  # noqa: F811
    path = moe_dir if request.param == "qwen3_moe" else model_dirs[request.param]
    llm = _llm(path)
    yield llm, hf_model(path)
    llm.shutdown()


def _check(llm, hf, ids, spec, edits):
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, steering_vectors=spec)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(ids, N)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    plain_tokens, plain_logprobs = HFSteered(hf, []).greedy(ids, N)
    assert plain_tokens != tokens or (logprobs - plain_logprobs).abs().max() > 0.05, "steering must change the output"


def _active_feature(llm, hf, name: str, ids: list[int], layer: int) -> int:
    """The feature of ``name`` at ``layer`` active on the most prompt rows (so a clamp changes them)."""
    tc = llm.engine.saes.get(name)
    x = hf_points(hf, ids)[(tc.hook, layer)]
    acts = tc.encode(x, layer)
    return (layer - tc.layer) * tc.d_transcoder + int((acts > 0).sum(0).argmax())


def test_feature_adds_write_at_every_decoded_layer(steered):
    llm, hf = steered
    clt, plt = llm.engine.saes.get("clt"), llm.engine.saes.get("plt")
    index = 5  # a layer-0 feature of the CLT: it decodes to layers 0, 1 and 2
    spec = SteeringSpec(features=[Feature("clt", index, scale=2.0), Feature("plt", 7, scale=-3.0,
                                                                            select=SelectSpec(generation="all"))])
    edits = [("mlp_out", layer, add_edit(2.0 * row), None) for layer, row in clt.decoder_rows(index)]
    edits.append(("mlp_out", 1, add_edit(-3.0 * plt.decoder_rows(7)[0][1]), SelectSpec(generation="all")))
    assert len(edits) == 4
    _check(llm, hf, llm.get_tokenizer()(PROMPTS[1]).input_ids, spec, edits)


def test_feature_clamps_read_the_input_and_write_the_output(steered):
    """A per-layer feature ablated (its own layer), a cross-layer feature of layer 0 set to a value
    (written at layers 0-2, read off the residual), a set's feature at half strength on prompt rows."""
    llm, hf = steered
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    plt_index = _active_feature(llm, hf, "plt", ids, 1)
    clt_index = _active_feature(llm, hf, "clt", ids, 0)
    set_index = _active_feature(llm, hf, "set", ids, 2)
    prompt = SelectSpec(prompt="all")
    spec = SteeringSpec(features=[FeatureClamp("plt", plt_index), FeatureClamp("clt", clt_index, value=4.0),
                                  FeatureClamp("set", set_index, value=3.0, strength=0.5, select=prompt)])
    edits = [*feature_clamp_edits(llm.engine.saes.get("plt"), plt_index, 0.0),
             *feature_clamp_edits(llm.engine.saes.get("clt"), clt_index, 4.0),
             *feature_clamp_edits(llm.engine.saes.get("set"), set_index, 3.0, 0.5, prompt)]
    _check(llm, hf, ids, spec, edits)


def test_ablation_removes_the_feature_from_the_reconstruction(family):
    """Ablating an active feature lowers the MLP's output by exactly its share ``a * W_dec``."""
    llm, hf = family
    tc = llm.engine.saes.get("plt")
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    index = _active_feature(llm, hf, "plt", ids, 1)
    capture = CaptureSpec(hook="mlp_out", layers=[1], select="all_prompt")
    plain, ablated = (llm.generate([ids], SamplingParams(max_tokens=1, capture=capture, steering_vectors=spec),
                                   use_tqdm=False)[0].captures["hidden_states"][1]
                      for spec in (None, SteeringSpec(features=[FeatureClamp("plt", index)])))
    share = activation(tc, index, hf_points(hf, ids)[("mlp_in", 1)]).unsqueeze(-1) * tc.decoder_rows(index)[0][1]
    assert share.abs().max() > 0.1
    torch.testing.assert_close(plain - ablated, share, atol=1e-4, rtol=1e-4)


def test_unsteered_neighbour_is_byte_identical(model_dirs):
    """Neighbours with transcoder adds and cross-layer clamps leave an unsteered request unchanged."""
    llm = _llm(model_dirs["qwen3"], enable_prefix_caching=False)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=3)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    plain = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    steered = [SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=3,
                              steering_vectors=SteeringSpec(features=[FeatureClamp("clt", i, value=2.0),
                                                                      Feature("plt", i, scale=2.0)]))
               for i in range(3)]
    mixed = llm.generate(PROMPTS[:4], [params] + steered, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    # Bit for bit as in the same batch unsteered (the CPU GEMMs round by batch size, not by steering).
    assert mixed[0].outputs[0].logprobs == plain[0].outputs[0].logprobs
    assert len({tuple(o.outputs[0].token_ids) for o in mixed[1:]}) > 1


# ---------------------------------------------------------------- scheduling


def test_chunked_prefill_prefix_cache_and_preemption(capture_dirs, model_dirs):
    """Features, error rows and clamped tokens are those of one unchunked, uncached request."""
    path = capture_dirs["qwen3"]
    hf = hf_model(path)
    llm = _llm(path, kv_cache_tokens=160, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)
    llm.generate(PROMPTS[3], SamplingParams(max_tokens=1), use_tqdm=False)  # its prompt blocks are cached now
    prompts = [PROMPTS[3], PROMPTS[5], PROMPTS[3], PROMPTS[7]]
    selects = ["all_generated", "all", "all", {"prompt_positions": [-1], "generation": "all"}]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                 capture=_capture(["clt", "plt"], s)) for s in selects], use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    for out in outs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        ref = hf_points(hf, ids)
        positions = out.capture_meta["sae_features"]["clt"].positions.tolist()
        assert positions == sorted(set(positions)) and positions[-1] == len(ids) - 2
        for name in ("clt", "plt"):
            tc = llm.engine.saes.get(name)
            assert_features_match(out.captures["sae_features"][name], reference_features(tc, ref, positions, TOP_K))
            torch.testing.assert_close(out.captures["transcoder_error"][name], reference_error(tc, ref, positions),
                                       atol=1e-4, rtol=1e-4)
    steer = _llm(model_dirs["qwen3"], kv_cache_tokens=160, max_num_batched_tokens=16, block_size=4)
    spec = SteeringSpec(features=[FeatureClamp("clt", 3, value=5.0), Feature("plt", 2, scale=3.0)])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, steering_vectors=spec)
    steer.generate(PROMPTS[3], params, use_tqdm=False)
    chunked = steer.generate(prompts, params, use_tqdm=False)
    whole = _llm(model_dirs["qwen3"], enable_prefix_caching=False)
    alone = [whole.generate(p, params, use_tqdm=False)[0] for p in prompts]
    assert steer.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in alone]


# ---------------------------------------------------------------- bad input


def test_bad_input_names_the_field_and_leaks_nothing(model_dirs):
    llm = _llm(model_dirs["qwen3"])
    try:
        for sae, field in [(random_transcoder(layers=2, layer=2, seed=5), r"transcoder\.layers: \[2, 3\] reach layer 3"),
                           (random_transcoder(layer=5, seed=5), r"transcoder\.layers: \[5\] reach layer 5"),
                           (random_transcoder(layer=1, d=32, seed=5), r"sae\.d_in: 32 does not match")]:
            with pytest.raises(ValueError, match=f"^{field}"):
                llm.register_sae("bad", sae)
        assert "bad" not in llm.list_saes()
        llm.register_sae("sae", __import__("test_sae_registry").random_sae(architecture="relu", layer=1))
        cases = [
            (CaptureSpec(stream="transcoder_error", saes=["sae"]), r"^capture\.saes: 'sae' is an SAE"),
            (CaptureSpec(stream="transcoder_error", saes=["nope"]), r"^capture\.saes: \['nope'\] are not registered"),
            (CaptureSpec(stream="sae_features", saes=["clt"], top_k=145), r"^capture\.top_k: must be an integer in \[1, 144\]"),
        ]
        for spec, pattern in cases:
            with pytest.raises(ValueError, match=pattern):
                llm.generate("Hello", SamplingParams(max_tokens=1, capture=spec), use_tqdm=False)
        for item, pattern in [(FeatureClamp("clt", 144), r"features\[0\]\.index: 144 is not a feature index in \[0, 144\)"),
                              (Feature("plt", 1, scale=float("nan")), r"features\[0\]\.scale"),
                              (FeatureClamp("set", 1, strength=2.0), r"features\[0\]\.strength")]:
            with pytest.raises(ValueError, match=f"^steering_vectors\\.{pattern}"):
                llm.generate("Hello", SamplingParams(max_tokens=1, steering_vectors=SteeringSpec(features=[item])),
                             use_tqdm=False)
        with pytest.raises(ValueError, match=r"^stream: 'transcoder_error' is captured per request"):
            llm.start_capture("transcoder_error", saes=["plt"])
        assert not llm.engine.requests and llm.get_steering_status()["rows_in_use"] == 0
        assert all(llm.engine.capture.features.in_use(name) is None for name in ("plt", "clt", "sae"))
        assert llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        llm.unregister_sae("clt")  # nothing holds it: it goes
        assert "clt" not in llm.list_saes()
    finally:
        llm.shutdown()
