"""Tensor and pipeline parallelism on CPU (gloo, float32): TP=2, PP=2 and TP=2 x PP=2 on Llama,
Qwen3 (one KV head, so TP=2 replicates it), Qwen3-MoE (experts split over the ranks) and Gemma 3
(sliding-window KV groups split over the stages) against one rank and HF transformers: greedy
tokens, logprobs, steering, captures (attention patterns included); preemption and prefix
caching; structured outputs (failures and torchrun: test_parallel_faults.py).

Every parallel engine lives in a module fixture (one at a time) and the ranks start from a fork
server (tests/parallel_harness.py), so the module stays short on two cores.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import PROMPTS, hf_greedy, hf_model
from parallel_harness import (RMS_FAMILIES, _engine, _env, _fork_server, _hang_guard, deadline,  # noqa: F401
                              models, single)

from steerable import LLM, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec
from steerable.capture import (ATTENTION_HEADS, ATTENTION_PATTERNS, HIDDEN_STATES, ROUTER_LOGITS,
                               match_capture_request_id)
from steerable.distributed.placement import MICRO_BATCHES_ENV, PARTITION_ENV

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}
FAMILIES = ["llama", "qwen3", "qwen3_moe", "gemma3"]
HOOKS = ["pre_attn", "post_attn", "post_mlp", "mlp_in", "mlp_out"]
TOKENS = 6
LOGPROB_TOL = 1e-4
CAPTURE_TOL = 1e-5


# The LayerNorm families (Conv1D / head-interleaved qkv shards, learned positions on the first
# stage, the parallel residual across a stage boundary, and NeoX's sequential residual) on TP=2
# and PP=2 only, for CI time.
LAYERNORM_CASES = [(layout, family) for layout in ("tp2", "pp2") for family in ("gpt2", "gpt_neox", "gpt_neox_seq")]


@pytest.fixture(scope="module", params=[(layout, family) for layout in LAYOUTS for family in FAMILIES]
                + [(layout, family) for layout in ("tp2", "pp2") for family in RMS_FAMILIES] + LAYERNORM_CASES,
                ids=lambda p: f"{p[0]}-{p[1]}")
def parallel(request, models):
    layout, family = request.param
    tp, pp = LAYOUTS[layout]
    # One layout takes the layers the other way round from the default [2, 1] (leftovers go first);
    # one keeps a micro-batch more than stages in flight.
    partition = "1,2" if (layout, family) == ("pp2", "qwen3") else None
    micro_batches = "3" if (layout, family) == ("pp2", "llama") else None
    with deadline(), _env(PARTITION_ENV, partition), _env(MICRO_BATCHES_ENV, micro_batches):
        llm = _engine(models[family], tensor_parallel_size=tp, pipeline_parallel_size=pp)
    yield family, llm
    with deadline(30):
        llm.shutdown()


def _vec(seed: int, scale: float = 3.0) -> list[float]:
    return (torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=3, **kw)


def _logprob_gap(a, b) -> float:
    """Largest |Δ logprob| over the entries both outputs report (the tokens must be equal)."""
    gap = 0.0
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert set(x) == set(y)
        gap = max([gap] + [abs(x[t].logprob - y[t].logprob) for t in x])
    return gap


def _same_outputs(outs, refs) -> float:
    """Tokens identical; returns the largest logprob gap."""
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    return max(_logprob_gap(o, r) for o, r in zip(outs, refs))


# ---------------------------------------------------------------- first, engines of their own
# (before the layout matrix: its module-scoped engine would still be alive after it)


# ---------------------------------------------------------------- scheduling under TP=2


def test_preemption_and_prefix_cache_under_tp2(models, single):
    """A KV cache too small for the batch (preemption by recompute) and a second pass that hits
    the prefix cache: the same tokens as one rank with room to spare."""
    prompts = [PROMPTS[5] + " " + PROMPTS[i] for i in range(len(PROMPTS))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in single["llama"].generate(prompts, params, use_tqdm=False)]
    with deadline():
        llm = LLM(models["llama"], dtype="float32", device="cpu", kv_cache_tokens=160, block_size=16,
                  tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0
        again = llm.generate(prompts[:2], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == ref[:2]
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > stats["prefix_cache_hit_tokens"]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_structured_outputs_under_tp_and_pp(models, single, tp, pp):
    """The grammar masks travel in the plain step input to every rank; on a pipeline each token is
    accepted before its request is planned again: the same tokens as one rank, constraints held."""
    import re

    pytest.importorskip("xgrammar")
    regex = r"[a-z]{2,5}( [a-z]{2,5}){1,3}"
    params = [SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": regex}),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=4, structured_outputs={"choice": ["ab cd", "ef"]})]
    prompts = PROMPTS[:3]
    ref = [o.outputs[0] for o in single["llama"].generate(prompts, params, use_tqdm=False)]
    with deadline():
        llm = LLM(models["llama"], dtype="float32", device="cpu", kv_cache_tokens=4096, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp)
    try:
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert re.fullmatch(regex, outs[0].text) and outs[2].text in ("ab cd", "ef")


# ---------------------------------------------------------------- greedy and logprobs


def test_greedy_matches_one_rank_and_hf(parallel, single, models):
    family, llm = parallel
    outs = llm.generate(PROMPTS[:4], _greedy(), use_tqdm=False)
    refs = single[family].generate(PROMPTS[:4], _greedy(), use_tqdm=False)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    hf = hf_model(models[family])
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, TOKENS), out.prompt


def test_streamed_outputs_grow_one_token_at_a_time(parallel):
    """Streaming progress shows each sampled token once, never a placeholder of a step in flight."""
    _, llm = parallel
    engine = llm.engine
    engine.add_request("streamed", PROMPTS[1], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                       stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += [out.outputs[0].token_ids for out in engine.step()]
    assert [len(tokens) for tokens in seen] == [1, 2, 3, 4, 5]
    assert all(tokens == seen[-1][:len(tokens)] for tokens in seen) and min(seen[-1]) >= 0


# ---------------------------------------------------------------- steering


def _steering_batch(num_layers: int) -> list[SamplingParams]:
    """32 distinct configs: adds and clamps at every hook point, inline, tiered, selected, with and
    without the registered module at different scales (all on top of a global spec)."""
    params = []
    for i in range(32):
        hook, layer = HOOKS[i % len(HOOKS)], i % num_layers
        kind = i % 4
        if kind == 0:
            spec = {hook: {layer: _vec(i)}}
        elif kind == 1:
            spec = SteeringSpec(clamps=[Clamp(layer, _vec(i), hook=hook, min=-0.5, max=0.5)])
        elif kind == 2:
            spec = SteeringSpec(prefill_vectors={layer: _vec(i)}, decode_vectors={(layer + 1) % num_layers: _vec(-i)})
        else:
            spec = SteeringSpec(clamps=[Clamp(layer, _vec(i), hook=hook, min=0.0, max=0.0,
                                              select=SelectSpec(generation="all"))])
        module = ("mod", 0.25 * (i % 5)) if i % 3 else None
        params.append(_greedy(steering_vectors=spec, steering_module_ref=module))
    return params


def _steer(llm: LLM, prompts, params):
    llm.set_steering_vectors({"post_attn": {1: _vec(1000, 1.0)}})
    llm.register_steering_modules({"mod": SteeringSpec(clamps=[Clamp(2, _vec(1001), hook="pre_attn", max=0.2)],
                                                       vectors={0: _vec(1002)})})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        status = llm.get_steering_status()
    finally:
        llm.clear_steering_vectors()
        llm.unregister_steering_modules(["mod"])
    return outs, status


def test_steering_batch_matches_one_rank(parallel, single):
    family, llm = parallel
    ref_llm = single[family]
    num_layers = ref_llm.engine.model_config.num_layers
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    params = _steering_batch(num_layers)
    outs, status = _steer(llm, prompts, params)
    refs, ref_status = _steer(ref_llm, prompts, params)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    assert status == ref_status and status["rows_in_use"] == 0
    assert llm.list_steerable_layers() == ref_llm.list_steerable_layers() == {h: list(range(num_layers))
                                                                               for h in HOOKS}
    # Effect size: steering really changed the outputs (a no-op would pass the equality above).
    plain = ref_llm.generate(prompts, _greedy(), use_tqdm=False)
    changed = sum(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(refs, plain))
    assert changed >= 16, changed


def _feature_run(llm: LLM, num_layers: int):
    """Feature adds and clamps of SAEs of each architecture at each hook point (TP: replicated
    rows; PP: the stage owning the layer), in a batch with unsteered requests; some requests
    capture features (every SAE on every row, or one on the last prompt row), and a stream records
    the first stage's SAE. Returns the outputs and the stream's (features, labels)."""
    from test_sae_registry import random_sae

    from steerable import Feature, FeatureClamp

    small = 0.05  # features of order one, where float32 sums agree to CAPTURE_TOL
    saes = {"j": random_sae(layer=num_layers - 1, hook="post_mlp", apply_b_dec_to_input=True, seed=1,
                            encoder_scale=small),
            "t": random_sae(architecture="topk", layer=0, hook="post_attn", seed=2, encoder_scale=small),
            "r": random_sae(architecture="relu", layer=min(1, num_layers - 1), hook="pre_attn", seed=3,
                            encoder_scale=small)}
    for name, sae in saes.items():
        llm.register_sae(name, sae)
    captures = [None, CaptureSpec(stream="sae_features", saes=list(saes), top_k=8, select="all"),
                CaptureSpec(stream="sae_features", saes=["j"], top_k=4, select="last_prompt")]
    params = []
    for i in range(12):
        features = [Feature("j", i, scale=3.0), FeatureClamp("t", i + 1, value=2.0),
                    FeatureClamp("r", 2 * i, value=0.0, select=SelectSpec(prompt="all"))][: i % 4]
        params.append(_greedy(steering_vectors=SteeringSpec(features=features) if features else None,
                              capture=captures[i % 3]))
    llm.start_capture("sae_features", saes=["t"], top_k=8, select="all_prompt")
    try:
        outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(12)], params, use_tqdm=False)
    finally:
        llm.stop_capture("sae_features")
        fetched = llm.fetch_captured("sae_features")
        for name in saes:
            llm.unregister_sae(name)
    return outs, fetched


def _assert_features_equal(ours, theirs, ours_meta, theirs_meta) -> None:
    """Indices identical, values within CAPTURE_TOL, labels exact."""
    assert ours_meta.positions.tolist() == theirs_meta.positions.tolist()
    assert ours_meta.token_ids.tolist() == theirs_meta.token_ids.tolist()
    assert torch.equal(ours.indices, theirs.indices)
    assert _max_abs_diff(ours.values, theirs.values) <= CAPTURE_TOL


def test_feature_steering_and_capture_match_one_rank(parallel, single):
    family, llm = parallel
    ref_llm = single[family]
    num_layers = ref_llm.engine.model_config.num_layers
    (outs, (stream, metas)), (refs, (ref_stream, ref_metas)) = _feature_run(llm, num_layers), _feature_run(
        ref_llm, num_layers)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    plain = ref_llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(12)], _greedy(), use_tqdm=False)
    changed = sum(o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(refs, plain))
    assert changed >= 4, changed  # effect size: feature steering changed outputs
    for out, ref in zip(outs, refs):
        assert out.captures.keys() == ref.captures.keys()
        for name, features in ref.captures.get("sae_features", {}).items():
            meta = out.capture_meta["sae_features"][name]
            _assert_features_equal(out.captures["sae_features"][name], features, meta,
                                   ref.capture_meta["sae_features"][name])
            assert all(match_capture_request_id(r, out.request_id) for r in meta.req_ids)
    assert sum("sae_features" in ref.captures for ref in refs) == 8
    assert list(stream) == ["t"] and len(ref_metas["t"]) == sum(len(r.prompt_token_ids) for r in refs)
    for out, ref in zip(outs, refs):  # the stream's rows, request by request (engine ids differ)
        mine = [j for j, rid in enumerate(metas["t"].req_ids) if match_capture_request_id(rid, out.request_id)]
        theirs = [j for j, rid in enumerate(ref_metas["t"].req_ids) if match_capture_request_id(rid, ref.request_id)]
        _assert_features_equal(stream["t"].select(torch.tensor(mine)), ref_stream["t"].select(torch.tensor(theirs)),
                               metas["t"].select(torch.tensor(mine)), ref_metas["t"].select(torch.tensor(theirs)))
    assert (ref_stream["t"].indices >= 0).any()  # features fire: a no-op would not pass


def _transcoder_run(llm: LLM, num_layers: int, crosses: bool):
    """A set of per-layer transcoders (capture, error node, feature clamps), a cross-layer one
    (feature adds; clamps and the error node too unless its decoders cross a pipeline stage, which
    is refused), in a batch with unsteered requests."""
    from transcoder_helpers import random_transcoder

    from steerable import Feature, FeatureClamp

    transcoders = {"set": random_transcoder(layers=num_layers, layer=0, architecture="relu", seed=1),
                   "clt": random_transcoder(layers=num_layers, layer=0, cross_layer=True, hook="post_attn", seed=2)}
    for name, tc in transcoders.items():
        llm.register_sae(name, tc)
    try:
        if llm.engine.config.pipeline_parallel_size > 1:  # the one-rank reference runs the same batch
            for params, field in [(_greedy(steering_vectors=SteeringSpec(features=[FeatureClamp("clt", 1)])),
                                   "steering_vectors.features[0].sae"),
                                  (_greedy(capture=CaptureSpec(stream="transcoder_error", saes=["clt"])), "capture.saes")]:
                with pytest.raises(ValueError, match=rf"^{re.escape(field)}: 'clt' decodes from one pipeline stage"):
                    llm.generate(PROMPTS[0], params, use_tqdm=False)
        errors = ["set"] + ([] if crosses else ["clt"])
        capture = [CaptureSpec(stream="sae_features", saes=["set", "clt"], top_k=8, select="all"),
                   CaptureSpec(stream="transcoder_error", saes=errors, select="all")]
        params = []
        for i in range(8):
            features = [Feature("clt", i, scale=2.0), FeatureClamp("set", 48 * (i % num_layers) + i, value=3.0)]
            if not crosses:
                features.append(FeatureClamp("clt", i + 3, value=2.0))
            params.append(_greedy(steering_vectors=SteeringSpec(features=features) if i % 3 else None,
                                  capture=capture if i % 2 else None))
        return llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(8)], params, use_tqdm=False)
    finally:
        for name in transcoders:
            llm.unregister_sae(name)


def test_transcoders_match_one_rank(parallel, single):
    family, llm = parallel
    if family not in ("qwen3", "qwen3_moe"):
        pytest.skip("transcoders run on two families here, for CI time")
    ref_llm = single[family]
    num_layers = ref_llm.engine.model_config.num_layers
    crosses = llm.engine.config.pipeline_parallel_size > 1
    outs, refs = _transcoder_run(llm, num_layers, crosses), _transcoder_run(ref_llm, num_layers, crosses)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    for out, ref in zip(outs, refs):  # features of order ten here: values to a relative 1e-5
        assert out.captures.keys() == ref.captures.keys()
        for name, features in ref.captures.get("sae_features", {}).items():
            ours = out.capture_meta["sae_features"][name]
            assert ours.positions.tolist() == ref.capture_meta["sae_features"][name].positions.tolist()
            assert torch.equal(out.captures["sae_features"][name].indices, features.indices)
            torch.testing.assert_close(out.captures["sae_features"][name].values, features.values, rtol=1e-5, atol=1e-5)
        for name, error in ref.captures.get("transcoder_error", {}).items():
            # the error is the MLP's output less the reconstruction, a difference that keeps the
            # absolute rounding of both. For the MoE at TP 2 it differs between runs of the same code
            # (3b07c4c alone: one run within 1e-4, the next 1.08e-4 off; a CI run 1.05e-4 on one
            # value of 6,336, an error of 0.19; cause not found): absolute 3e-4
            torch.testing.assert_close(out.captures["transcoder_error"][name], error, rtol=1e-5, atol=3e-4)
    assert sum("transcoder_error" in ref.captures for ref in refs) == 4


# ---------------------------------------------------------------- capture


def _capture_run(llm: LLM, family: str):
    """Streams (hidden states at pre_attn, attention heads, router logits) and per-request
    captures at post_attn / post_mlp, in one batch where some requests capture nothing; some also
    capture attention heads of one layer, a second gather group at a site the stream reads."""
    streams = [HIDDEN_STATES, ATTENTION_HEADS] + ([ROUTER_LOGITS] if family == "qwen3_moe" else [])
    llm.start_capture(HIDDEN_STATES, hook="pre_attn")
    llm.start_capture(ATTENTION_HEADS, select="all_prompt")
    if family == "qwen3_moe":
        llm.start_capture(ROUTER_LOGITS)
    params = []
    for i in range(len(PROMPTS)):
        capture = [None, [CaptureSpec(hook="post_attn", select="all"), CaptureSpec(ATTENTION_HEADS, layers=[1])],
                   CaptureSpec(hook="post_mlp", layers=[0, 2], select="last_prompt")][i % 3]
        params.append(_greedy(capture=capture))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    fetched = {}
    for stream in streams:
        fetched[stream] = llm.fetch_captured(stream)
        llm.stop_capture(stream)
    return outs, fetched


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


def _rows_by_prompt(outs, tensors, meta):
    """Per prompt index and layer: (positions, token ids, values), so runs with different internal
    request ids compare label for label."""
    rows = {}
    for layer, tensor in tensors.items():
        m = meta[layer]
        for i, out in enumerate(outs):
            picked = [j for j, rid in enumerate(m.req_ids) if match_capture_request_id(rid, out.request_id)]
            rows[i, layer] = (m.positions[picked].tolist(), m.token_ids[picked].tolist(), tensor[picked])
    return rows


def _assert_rows_equal(ours: dict, refs: dict) -> None:
    assert ours.keys() == refs.keys()
    for key, (positions, tokens, values) in refs.items():
        assert ours[key][:2] == (positions, tokens), key
        assert _max_abs_diff(values, ours[key][2]) <= CAPTURE_TOL, key


def test_captures_match_one_rank(parallel, single):
    family, llm = parallel
    outs, fetched = _capture_run(llm, family)
    refs, ref_fetched = _capture_run(single[family], family)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    for stream, (tensors, meta) in ref_fetched.items():
        assert tensors, stream
        _assert_rows_equal(_rows_by_prompt(outs, *fetched[stream]), _rows_by_prompt(refs, tensors, meta))
    for out, ref in zip(outs, refs):
        assert out.captures.keys() == ref.captures.keys()
        for stream, layers in ref.captures.items():
            for layer, value in layers.items():
                ours, theirs = out.capture_meta[stream][layer], ref.capture_meta[stream][layer]
                assert ours.positions.tolist() == theirs.positions.tolist()
                assert ours.token_ids.tolist() == theirs.token_ids.tolist()
                assert all(match_capture_request_id(r, out.request_id) for r in ours.req_ids)
                assert _max_abs_diff(out.captures[stream][layer], value) <= CAPTURE_TOL
    heads = fetched[ATTENTION_HEADS][0]
    cfg = single[family].engine.model_config
    assert all(t.shape[1] == cfg.num_heads * cfg.head_dim for t in heads.values())  # gathered to the full width


def _pattern_run(llm: LLM, num_layers: int):
    """Attention patterns of every layer (the last one on the second pipeline stage) and all heads
    (split over the tensor-parallel ranks), and of two heads from different ranks for the prompt's
    first and last rows and every generated one; one request captures nothing."""
    capture = [CaptureSpec(ATTENTION_PATTERNS, select="all"), None,
               CaptureSpec(ATTENTION_PATTERNS, layers=[0, num_layers - 1], heads=[3, 0],
                           select=SelectSpec(prompt_positions=[0, -1], generation="all"))]
    return llm.generate(PROMPTS[:3], [_greedy(capture=c) for c in capture], use_tqdm=False)


def test_attention_patterns_match_one_rank(parallel, single):
    family, llm = parallel
    cfg = single[family].engine.model_config
    outs, refs = _pattern_run(llm, cfg.num_layers), _pattern_run(single[family], cfg.num_layers)
    assert _same_outputs(outs, refs) <= LOGPROB_TOL
    for out, ref in zip(outs, refs):
        assert out.captures.keys() == ref.captures.keys()
        for layer, want in ref.captures.get(ATTENTION_PATTERNS, {}).items():
            pat, meta = out.captures[ATTENTION_PATTERNS][layer], out.capture_meta[ATTENTION_PATTERNS][layer]
            want_meta = ref.capture_meta[ATTENTION_PATTERNS][layer]
            assert (meta.positions.tolist(), meta.token_ids.tolist()) == (want_meta.positions.tolist(),
                                                                          want_meta.token_ids.tolist())
            assert all(match_capture_request_id(r, out.request_id) for r in meta.req_ids)
            assert pat.heads == want.heads and len(pat) == len(want) > 0
            assert torch.equal(pat.key_starts, want.key_starts) and torch.equal(pat.key_lens, want.key_lens)
            assert max(_max_abs_diff(a, b) for a, b in zip(pat.rows, want.rows)) <= CAPTURE_TOL, layer
    every, last_layer = outs[0].captures[ATTENTION_PATTERNS], cfg.num_layers - 1
    assert sorted(every) == list(range(cfg.num_layers)) and every[last_layer].heads == list(range(cfg.num_heads))
    prompt_len = len(outs[2].prompt_token_ids)
    assert outs[2].captures[ATTENTION_PATTERNS][last_layer].heads == [0, 3]
    assert outs[2].capture_meta[ATTENTION_PATTERNS][last_layer].positions.tolist() == \
        [0, *range(prompt_len - 1, prompt_len + TOKENS - 1)]  # prompt rows and every generated row
    last = every[last_layer].rows[-1]
    assert (last - 1 / last.shape[1]).abs().max() > 1e-3  # real distributions, not uniform rows
