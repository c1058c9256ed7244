"""Steering plane: exact against HF hooks at each point, tiers, selection, composition, isolation,
cache safety, preemption and bad input."""

import math
import random

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap

from steerable import LLM, Add, Clamp, SamplingParams, SelectSpec, SteeringSpec

N = 10
FAMILIES = ["llama", "qwen3", "gemma3", "gemma2", "olmo2", "phi3", "gpt2", "gpt_neox"]


def greedy(**kw):
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


def vec(seed, size=64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, generator=g) * scale).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    return llm, hf_model(path)


def _ids(llm, text):
    return llm.get_tokenizer()(text).input_ids


def _check(llm, hf, prompt_ids, steering, edits, **kw):
    """Engine with ``steering`` == HF with ``edits``; and steering visibly changes the output."""
    out = llm.generate([prompt_ids], greedy(steering_vectors=steering, **kw), use_tqdm=False)[0]
    ref_tokens, ref_lp = HFSteered(hf, edits).greedy(prompt_ids, N)
    assert out.outputs[0].token_ids == ref_tokens
    assert max_logprob_gap(out, ref_lp) <= 1e-4
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(prompt_ids, N)
    effect = (ref_lp - plain_lp).abs().max().item()
    assert plain_tokens != ref_tokens or effect > 0.05, "steering must change the output (effect-size check)"
    return out


@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_mlp"])
def test_add_matches_hf_hook(family, hook):
    llm, hf = family
    v = vec(1)
    _check(llm, hf, _ids(llm, PROMPTS[1]), {hook: {1: v}}, [(hook, 1, add_edit(v), None)])


@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_mlp"])
def test_clamp_matches_hf_hook(family, hook):
    llm, hf = family
    d = vec(2)
    spec = SteeringSpec(clamps=[Clamp(1, d, hook=hook, min=-0.5, max=0.5, strength=1.0)])
    _check(llm, hf, _ids(llm, PROMPTS[3]), spec, [(hook, 1, clamp_edit(d, -0.5, 0.5), None)])


def test_ablation_and_partial_strength(family):
    llm, hf = family
    d1, d2 = vec(3), vec(4)
    spec = SteeringSpec(clamps=[Clamp(0, d1, min=0.0, max=0.0), Clamp(2, d2, hook="pre_attn", min=1.0,
                                                                            strength=0.5)])
    _check(llm, hf, _ids(llm, PROMPTS[5]), spec,
           [("post_mlp", 0, clamp_edit(d1, 0.0, 0.0), None), ("pre_attn", 2, clamp_edit(d2, 1.0, None, 0.5), None)])


def test_shorthand_layer_dict_is_post_mlp_and_multi_site(family):
    llm, hf = family
    v0, v2 = vec(5), vec(6)
    _check(llm, hf, _ids(llm, PROMPTS[0]), {0: v0, 2: {"vector": v2, "scale": 0.5}},
           [("post_mlp", 0, add_edit(v0), None), ("post_mlp", 2, add_edit([x * 0.5 for x in v2]), None)])


@pytest.mark.parametrize("select", [
    SelectSpec(prompt_positions=[-1]),
    SelectSpec(prompt_window=(2, 6)),
    SelectSpec(generation_window=(1, 4)),
    "all_generated",
    "all_prompt",
    SelectSpec(exclude_prompt_positions=[0, 1, 2]),
])
def test_selection_matches_hf_at_those_positions(family, select):
    llm, hf = family
    v = vec(7)
    sel = SelectSpec.parse(select)
    spec = SteeringSpec(interventions=[Add(1, v, hook="post_mlp", select=sel)])
    _check(llm, hf, _ids(llm, PROMPTS[5]), spec, [("post_mlp", 1, add_edit(v), sel)])


def test_token_selection(family):
    llm, hf = family
    ids = _ids(llm, PROMPTS[1])
    sel = SelectSpec(prompt_tokens=[ids[1], ids[3]])
    v = vec(8)
    _check(llm, hf, ids, SteeringSpec(interventions=[Add(0, v, select=sel)]), [("post_mlp", 0, add_edit(v), sel)])


def test_tiers_prefill_and_decode(family):
    llm, hf = family
    ids = _ids(llm, PROMPTS[3])
    vp, vd = vec(9), vec(10)
    spec = SteeringSpec(prefill_vectors={1: vp}, decode_vectors={"pre_attn": {2: vd}})
    _check(llm, hf, ids, spec, [("post_mlp", 1, add_edit(vp), SelectSpec(prompt="all")),
                                ("pre_attn", 2, add_edit(vd), SelectSpec(generation="all"))])


def test_scale_zero_is_byte_identical_and_modules_scale(family):
    llm, hf = family
    ids = _ids(llm, PROMPTS[5])
    v = vec(11)
    plain = llm.generate([ids], greedy(), use_tqdm=False)[0].outputs[0]
    llm.register_steering_modules({"happy": {1: v}, "clampy": SteeringSpec(clamps=[Clamp(1, vec(12), max=0.0)])})
    try:
        zero = llm.generate([ids], greedy(steering_module_ref=("happy", 0.0)), use_tqdm=False)[0].outputs[0]
        inline_zero = llm.generate([ids], greedy(steering_vectors=SteeringSpec(vectors={1: v}, scale=0.0)),
                                   use_tqdm=False)[0].outputs[0]
        clamp_zero = llm.generate([ids], greedy(steering_module_ref=("clampy", 0)), use_tqdm=False)[0].outputs[0]
        for out in (zero, inline_zero, clamp_zero):
            assert out.token_ids == plain.token_ids
            assert [{t: lp.logprob for t, lp in e.items()} for e in out.logprobs] == \
                   [{t: lp.logprob for t, lp in e.items()} for e in plain.logprobs]
        scaled = llm.generate([ids], greedy(steering_module_ref=("happy", 0.7)), use_tqdm=False)[0]
        inline = llm.generate([ids], greedy(steering_vectors={1: [x * 0.7 for x in v]}), use_tqdm=False)[0]
        assert scaled.outputs[0].token_ids == inline.outputs[0].token_ids
        assert max_logprob_gap(scaled, torch.stack([_dense(e) for e in inline.outputs[0].logprobs])) < 1e-5
        assert scaled.outputs[0].token_ids != plain.token_ids or max_logprob_gap(
            scaled, torch.stack([_dense(e) for e in plain.logprobs])) > 0.05
    finally:
        llm.unregister_steering_modules(["happy", "clampy"])


def _dense(entry, vocab=512):
    row = torch.full((vocab,), float("nan"))
    for t, lp in entry.items():
        row[t] = lp.logprob
    return row


def test_global_module_inline_compose_additively(family):
    llm, hf = family
    ids = _ids(llm, PROMPTS[1])
    g, m, i = vec(13), vec(14), vec(15)
    llm.set_steering_vectors({"pre_attn": {1: g}})
    llm.register_steering_modules({"m": {2: m}})
    try:
        out = llm.generate([ids], greedy(steering_module_ref=("m", 2.0), steering_vectors={2: i}),
                           use_tqdm=False)[0]
        ref_tokens, ref_lp = HFSteered(hf, [("pre_attn", 1, add_edit(g), None),
                                            ("post_mlp", 2, add_edit([2 * a + b for a, b in zip(m, i)]), None)]
                                       ).greedy(ids, N)
        assert out.outputs[0].token_ids == ref_tokens
        assert max_logprob_gap(out, ref_lp) <= 1e-4
    finally:
        llm.clear_steering_vectors()
        llm.unregister_steering_modules("m")
    assert llm.get_steering_status()["rows_in_use"] == 0


def test_mixed_batch_of_64_isolation_and_equivalence(model_dirs):
    path = model_dirs["qwen3"]
    llm = LLM(path, device="cpu", kv_cache_tokens=16384)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(3, 40))] for _ in range(64)]
    configs = [{rng.choice(["pre_attn", "post_attn", "post_mlp"]): {rng.randrange(3): vec(100 + c)}}
               for c in range(32)]
    params = []
    for r in range(64):
        if r % 2 == 0:
            params.append(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                         steering_vectors=configs[r // 2]))
        else:
            params.append(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    outs = llm.generate(prompts, params, use_tqdm=False)
    status = llm.get_steering_status()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0
    baseline = LLM(path, device="cpu", kv_cache_tokens=16384).generate(
        prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 64, use_tqdm=False)
    changed = 0
    for r in range(64):
        if r % 2:  # unsteered: byte-identical to a run with steering disabled entirely
            assert outs[r].outputs[0].token_ids == baseline[r].outputs[0].token_ids
        else:
            alone = llm.generate([prompts[r]], params[r], use_tqdm=False)[0]
            assert outs[r].outputs[0].token_ids == alone.outputs[0].token_ids
            changed += outs[r].outputs[0].token_ids != baseline[r].outputs[0].token_ids
    assert changed >= 16


def test_prefix_cache_respects_prefill_steering(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    def hit_tokens():
        return llm.llm_engine.stats()["prefix_cache_hit_tokens"]

    prefix = list(range(20, 84))  # 64 tokens = 4 full blocks
    p1, p2 = prefix + [7, 8, 9], prefix + [10, 11, 12]
    v = vec(20)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([p1], plain, use_tqdm=False)
    hits = hit_tokens()
    steered = llm.generate([p2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                steering_vectors={1: v}), use_tqdm=False)[0]
    assert hit_tokens() == hits, "prefill-steered request must not reuse unsteered prompt blocks"
    # Its output equals a cold run of the same steered request.
    cold = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192, enable_prefix_caching=False)
    assert steered.outputs[0].token_ids == cold.generate(
        [p2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, steering_vectors={1: v}),
        use_tqdm=False)[0].outputs[0].token_ids
    # Decode-only steering shares the prompt blocks.
    llm.generate([p2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                      steering_vectors=SteeringSpec(decode_vectors={1: v})), use_tqdm=False)
    assert hit_tokens() >= hits + 64
    # Global prefill steering changes: no reuse of KV computed under the old one.
    llm.set_steering_vectors({0: vec(21)})
    hits = hit_tokens()
    a = llm.generate([p1], plain, use_tqdm=False)[0]
    llm.set_steering_vectors({0: vec(22)})
    b = llm.generate([p1], plain, use_tqdm=False)[0]
    assert hit_tokens() == hits
    llm.clear_steering_vectors()
    cold.set_steering_vectors({0: vec(22)})
    assert b.outputs[0].token_ids == cold.generate([p1], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids  # the two global specs really differ in effect


def test_prompt_position_steering_keeps_leading_blocks_shareable(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=8192)
    prompt = list(range(20, 90))  # 70 tokens
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], plain, use_tqdm=False)
    hits = llm.llm_engine.stats()["prefix_cache_hit_tokens"]
    last_only = SteeringSpec(interventions=[Add(1, vec(23), select="last_prompt")])
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                          steering_vectors=last_only), use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_hit_tokens"] - hits == 64  # blocks before position 69 are untouched by steering


@pytest.mark.parametrize("engine_kw", [dict(max_num_batched_tokens=16), dict(kv_cache_tokens=320)])
def test_preemption_and_chunked_prefill_keep_steered_outputs(model_dirs, engine_kw):
    path = model_dirs["qwen3"]
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(20, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                             steering_vectors=SteeringSpec(prefill_vectors={1: vec(30 + i)},
                                                           decode_vectors={"pre_attn": {2: vec(60 + i)}},
                                                           interventions=[Add(0, vec(90 + i), select=SelectSpec(
                                                               prompt_positions=[-1, -3], generation_positions=[2]))]))
              if i % 3 else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for i in range(12)]
    ref = LLM(path, device="cpu", kv_cache_tokens=8192, enable_prefix_caching=False)
    expected = [ref.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(path, device="cpu", **{"kv_cache_tokens": 8192, **engine_kw})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "kv_cache_tokens" in engine_kw:
        assert llm.engine.stats()["num_preemptions"] > 0
    status = llm.get_steering_status()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0


@pytest.mark.parametrize("steering, field", [
    ({1: [1.0] * 10}, "hidden size"),
    ({1: [float("nan")] * 64}, "NaN"),
    ({1: [float("inf")] * 64}, "NaN or Inf"),
    ({"mid_attn": {1: [0.0] * 64}}, "hook"),
    ({7: [0.0] * 64}, "layer"),
    ({-1: [0.0] * 64}, "layer"),
    (SteeringSpec(clamps=[Clamp(1, [1.0] * 64, min=2.0, max=1.0)]), "min"),
    (SteeringSpec(clamps=[Clamp(1, [1.0] * 64, strength=1.5)]), "strength"),
    (SteeringSpec(clamps=[Clamp(1, [0.0] * 64)]), "direction"),
    (SteeringSpec(interventions=[Add(1, [0.0] * 64, select={"prompt_window": [5, 2]})]), "select"),
    ("not a spec", "steering_vectors"),
])
def test_bad_steering_input(model_dirs, steering, field):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match=field) as err:
        llm.generate(["hello"], SamplingParams(max_tokens=2, steering_vectors=steering), use_tqdm=False)
    assert "steering_vectors" in str(err.value)
    assert llm.get_steering_status()["rows_in_use"] == 0 and llm.llm_engine.stats()["num_requests"] == 0
    with pytest.raises(ValueError, match="steering_module_ref"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, steering_module_ref="ghost"), use_tqdm=False)
    with pytest.raises(ValueError, match="steering"):
        llm.set_steering_vectors({1: [1.0] * 3})
    with pytest.raises(ValueError, match="modules"):
        llm.unregister_steering_modules(["ghost"])
    good = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(good.outputs[0].token_ids) == 3


def test_list_layers_and_status(model_dirs):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    assert llm.list_steerable_layers() == {p: [0, 1, 2] for p in ("pre_attn", "post_attn", "post_mlp", "mlp_in",
                                                                  "mlp_out")}
    llm.set_steering_vectors({1: vec(1)})
    status = llm.get_steering_status()
    assert status["global"]["adds"] == 1 and status["global"]["sites"] == ["post_mlp:1"]


def test_generated_token_selection_matches_hf(family):
    """Selecting generated rows by token id needs each sampled token before the next step is planned
    (the engine plans that step after the token arrives)."""
    llm, hf = family
    ids = _ids(llm, PROMPTS[3])
    plain = llm.generate([ids], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    sel = SelectSpec(generation_tokens=sorted(set(plain[:5])))
    v = vec(31)
    _check(llm, hf, ids, SteeringSpec(interventions=[Add(1, v, select=sel)]), [("post_mlp", 1, add_edit(v), sel)])


def _interventions(parser, spec):
    return parser.parse(spec, "steering_vectors")


def test_table_rows_reused_after_a_clear_hold_only_the_new_values():
    """Writes and clears travel to the worker in the next step's update; a row freed and reused
    before it is sent must end up with the new config's values at its sites and zeros elsewhere,
    including clamp slots it no longer uses."""
    from steerable.steering.rows import RowTables
    from steerable.steering.spec import SpecParser
    from steerable.steering.tables import SteeringTables

    parser, ledger = SpecParser(8, 4), RowTables(4, 8)
    tables = SteeringTables(8, torch.device("cpu"), torch.float32)
    first = _interventions(parser, SteeringSpec(vectors={"post_mlp": {0: [1.0] * 8}, "pre_attn": {2: [2.0] * 8}},
                                                clamps=[Clamp(1, [1.0] + [0.0] * 7, max=0.5)]))
    ledger.write(1, first)
    tables.apply(ledger.take_update())
    assert tables.add[("post_mlp", 0)][1].tolist() == [1.0] * 8
    assert tables.clamp_bounds[("post_mlp", 1)][1, 0].tolist() == [-math.inf, 0.5, 1.0, 1.0]
    ledger.clear(1)
    ledger.write(1, _interventions(parser, {"pre_attn": {2: [3.0] * 8}}))
    assert tables.add[("post_mlp", 0)][1].tolist() == [1.0] * 8  # nothing moves before the update
    tables.apply(ledger.take_update())
    assert tables.add[("post_mlp", 0)][1].tolist() == [0.0] * 8
    assert tables.add[("pre_attn", 2)][1].tolist() == [3.0] * 8
    assert tables.add[("pre_attn", 2)][0].tolist() == [0.0] * 8  # row 0 stays zero
    assert tables.clamp_bounds[("post_mlp", 1)][1, 0, 2].item() == 0.0  # strength 0: the clamp is gone
    assert ledger.take_update() is None  # nothing left to send


def test_graph_key_tells_an_added_clamp_from_an_add_at_the_same_site():
    """A CUDA graph bakes in which op runs at each site: a clamp joining a site that only added
    before must change the steering signature, or a stale graph would skip the clamp."""
    from steerable.steering.rows import RowTables
    from steerable.steering.spec import SpecParser

    parser, tables = SpecParser(8, 4), RowTables(4, 8)
    tables.write(1, _interventions(parser, {"post_mlp": {0: [1.0] * 8}}))
    before = tables.live_sites()
    tables.write(2, _interventions(parser, [Clamp(0, [1.0] + [0.0] * 7, hook="post_mlp", max=0.0)]))
    after = tables.live_sites()
    assert before == (frozenset({("post_mlp", 0)}), frozenset())
    assert after == (frozenset({("post_mlp", 0)}), frozenset({("post_mlp", 0)}))


def test_plan_sites_outlive_their_rows_until_the_tables_are_idle():
    """The sites a step applies (and its CUDA-graph key names) keep a site whose last row was freed
    while other rows live, so a workload's tail does not capture new graphs each time the last
    request of one config finishes; once no row lives they start again from nothing. What the
    status reports as active stays exact."""
    from steerable.steering.rows import RowTables
    from steerable.steering.spec import SpecParser

    parser, tables = SpecParser(8, 4), RowTables(4, 8)
    tables.write(1, _interventions(parser, {"post_mlp": {0: [1.0] * 8}}))
    tables.write(2, _interventions(parser, [Clamp(1, [1.0] + [0.0] * 7, hook="post_attn", max=0.0)]))
    both = (frozenset({("post_mlp", 0)}), frozenset({("post_attn", 1)}))
    assert tables.plan_sites() == both
    tables.clear(2)
    assert tables.plan_sites() is tables.plan_sites() and tables.plan_sites() == both
    assert tables.live_sites() == (frozenset({("post_mlp", 0)}), frozenset())
    tables.clear(1)
    assert tables.plan_sites() == (frozenset(), frozenset())
    tables.write(1, _interventions(parser, {"pre_attn": {3: [1.0] * 8}}))
    assert tables.plan_sites() == (frozenset({("pre_attn", 3)}), frozenset())
