"""Conditional steering (``When``): the gate reads ``h · d / |d|`` (or an SAE feature's activation)
at its point before that point's edits; ``scope="token"`` gates row by row, ``scope="prompt"``
decides once from the mean over the prompt for the generated rows. Equal to HF hooks doing the
same, on Llama, Qwen3 and Gemma 3; a prompt that does not pass is byte-identical to unsteered; two
gates in one config; chunked prefill, preemption and the prefix cache."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap
from intervention_oracle import check_chunked_and_preempted, Gate, lowrank_delta, orthonormal_rows, plus, rand
from test_sae_registry import random_sae
from transformers import AutoTokenizer

from steerable import LLM, Add, Clamp, Feature, LowRank, SamplingParams, SelectSpec, SteeringSpec, When

N = 8
H = 64
FAMILIES = ["llama", "qwen3", "gemma3"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    yield request.param, llm, hf_model(path)
    llm.shutdown()


def _ids(llm, text):
    return llm.get_tokenizer()(text).input_ids


def _readings(hf, prompt_ids, site, direction=None, feature=None) -> torch.Tensor:
    """The gate's reading at every prompt row of an unsteered HF forward."""
    capture = {}
    HFSteered(hf, []).forward(torch.tensor([prompt_ids]), len(prompt_ids), capture=capture)
    return Gate(direction, feature=feature).value(capture[site])


def _split(readings: torch.Tensor) -> float:
    """A threshold halfway between two middle readings: some rows pass, others not, none at a tie."""
    ordered = readings.sort().values
    middle = len(ordered) // 2
    return float(ordered[middle - 1] + ordered[middle]) / 2


def _scale(name: str) -> float:
    return 3.0 if name == "gemma3" else 1.0  # Gemma's residual stream is large


def test_token_scope_gates_row_by_row(family):
    """A gate at post_attn 1 whose threshold splits the rows, gating a LoReFT at its own point,
    a clamp and an add at later ones."""
    name, llm, hf = family
    prompt = _ids(llm, PROMPTS[5])
    d = rand(H, seed=1)
    threshold = _split(_readings(hf, prompt, ("post_attn", 1), d))
    R, W, b = orthonormal_rows(3, H, 2), rand(3, H, seed=3, scale=_scale(name)), rand(3, seed=4, scale=_scale(name))
    v, c = rand(H, seed=5, scale=3 * _scale(name)), rand(H, seed=6)
    spec = SteeringSpec(interventions=[When([LowRank(1, R, W, b, hook="post_attn"), Clamp(2, c, hook="pre_attn", max=0.0),
                                             Add(2, v)], 1, d, threshold, hook="post_attn")])
    gate = Gate(d, threshold, prompt_len=len(prompt))
    edits = [("post_attn", 1, gate.read(), None), ("post_attn", 1, gate.gated(plus(lowrank_delta(R, W, b))), None),
             ("pre_attn", 2, gate.gated(clamp_edit(c, None, 0.0)), None), ("post_mlp", 2, gate.gated(add_edit(v)), None)]
    out = llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, N)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert gate.mask.any() and not gate.mask.all(), "the gate must pass some rows and not others"
    plain, _ = HFSteered(hf, []).greedy(prompt, N)
    assert plain != tokens


def test_gates_and_edits_at_the_mlp_points(family):
    """A gate reading the MLP's input (``mlp_in``, after its norm) over a LoReFT on what the MLP adds
    (``mlp_out``) and an add on the layer output."""
    name, llm, hf = family
    prompt = _ids(llm, PROMPTS[1])
    d = rand(H, seed=60)
    threshold = _split(_readings(hf, prompt, ("mlp_in", 1), d))
    R, W, b = orthonormal_rows(2, H, 61), rand(2, H, seed=62, scale=2.0), rand(2, seed=63, scale=2.0)
    v = rand(H, seed=64, scale=3 * _scale(name))
    spec = SteeringSpec(interventions=[When([LowRank(1, R, W, b, hook="mlp_out"), Add(1, v)], 1, d, threshold,
                                            hook="mlp_in")])
    gate = Gate(d, threshold, prompt_len=len(prompt))
    edits = [("mlp_in", 1, gate.read(), None), ("mlp_out", 1, gate.gated(plus(lowrank_delta(R, W, b))), None),
             ("post_mlp", 1, gate.gated(add_edit(v)), None)]
    out = llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, N)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert gate.mask.any() and not gate.mask.all()
    with pytest.raises(ValueError, match="before the gate"):
        llm.generate([prompt], greedy(steering_vectors=SteeringSpec(interventions=[
            When([Add(1, v, hook="post_attn")], 1, d, threshold, hook="mlp_in")])), use_tqdm=False)


def test_prompt_scope_decides_once_for_generated_rows(family):
    """Two requests gated on the prompt's mean reading, one above its threshold and one below,
    beside an unsteered one: the first gets the items on every generated row (its first token is
    the unsteered one), the second is byte-identical to unsteered."""
    name, llm, hf = family
    prompt = _ids(llm, PROMPTS[3])
    d = rand(H, seed=10)
    mean = float(_readings(hf, prompt, ("post_mlp", 1), d)[:len(prompt)].mean())
    v = rand(H, seed=11, scale=4 * _scale(name))
    R, W, b = orthonormal_rows(2, H, 12), rand(2, H, seed=13, scale=_scale(name)), rand(2, seed=14)

    def spec(threshold):
        return SteeringSpec(interventions=[When([Add(2, v, hook="pre_attn"), LowRank(1, R, W, b)], 1, d, threshold,
                                                scope="prompt")])
    outs = llm.generate([prompt] * 3, [greedy(steering_vectors=spec(mean - 0.25)),
                                       greedy(steering_vectors=spec(mean + 0.25)), greedy()], use_tqdm=False)
    passed, failed, plain = outs
    gate = Gate(d, mean - 0.25, scope="prompt", prompt_len=len(prompt))
    edits = [("post_mlp", 1, gate.read(), None), ("post_mlp", 1, gate.gated(plus(lowrank_delta(R, W, b))), None),
             ("pre_attn", 2, gate.gated(add_edit(v)), None)]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, N)
    assert passed.outputs[0].token_ids == tokens and max_logprob_gap(passed, logprobs) <= 1e-4
    assert all(abs(m - gate.means[0]) < 1e-6 for m in gate.means)  # the prompt's mean, whatever was generated
    assert passed.outputs[0].token_ids[0] == plain.outputs[0].token_ids[0]
    assert passed.outputs[0].token_ids != plain.outputs[0].token_ids
    assert failed.outputs[0].token_ids == plain.outputs[0].token_ids
    assert _logprobs(failed) == _logprobs(plain)
    assert llm.get_steering_status()["rows_in_use"] == 0


def _logprobs(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in entry.items()} for entry in out.outputs[0].logprobs]


def test_feature_gate_and_compare_below(model_dirs):
    """Goodfire's ``set_when``: the gate reads an SAE feature's activation (at the SAE's point);
    ``compare="<"`` passes below the threshold."""
    path = model_dirs["llama"]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    hf = hf_model(path)
    sae = random_sae(architecture="jumprelu", layer=1, hook="post_attn", apply_b_dec_to_input=True, seed=7)
    llm.register_sae("mid1", sae)
    prompt = _ids(llm, PROMPTS[1])
    e, bias, floor = sae.feature_read(11)
    activations = _readings(hf, prompt, ("post_attn", 1), feature=(e, bias, floor))
    threshold = _split(activations) if activations.median() > 0 else float(activations.max()) / 2
    v = rand(H, seed=20, scale=3.0)
    spec = SteeringSpec(interventions=[When([Add(1, v)], 1, Feature("mid1", 11), threshold, hook="post_attn",
                                            compare="<")])
    gate = Gate(threshold=threshold, compare="<", feature=(e, bias, floor), prompt_len=len(prompt))
    edits = [("post_attn", 1, gate.read(), None), ("post_mlp", 1, gate.gated(add_edit(v)), None)]
    out = llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, N)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert gate.mask.any() and not gate.mask.all()
    with pytest.raises(ValueError, match=r"interventions\[0\]\.hook: 'post_mlp', but SAE 'mid1' reads 'post_attn'"):
        llm.generate([prompt], greedy(steering_vectors=SteeringSpec(interventions=[
            When([Add(2, v)], 1, Feature("mid1", 11), threshold)])), use_tqdm=False)
    with pytest.raises(ValueError, match="in use by steering module .gated."):  # the gate uses the SAE
        llm.register_steering_modules({"gated": spec})
        llm.unregister_sae("mid1")
    llm.unregister_steering_modules(["gated"])


def test_two_gates_and_distinct_configs_in_one_batch(model_dirs):
    """Each request with its own pair of gates (a token one and a prompt one, items under each and
    one ungated add), beside unsteered requests that stay byte-identical to a batch without
    steering; every steered one equals HF."""
    path = model_dirs["qwen3"]
    llm = LLM(path, device="cpu", kv_cache_tokens=16384)
    hf = hf_model(path)
    prompts = [_ids(llm, PROMPTS[i]) for i in range(6)]
    specs, edit_lists = [], []
    for i in range(4):
        prompt = prompts[i]
        d1, d2 = rand(H, seed=30 + i), rand(H, seed=40 + i)
        t1 = _split(_readings(hf, prompt, ("post_attn", 0), d1))
        t2 = float(_readings(hf, prompt, ("pre_attn", 1), d2)[:len(prompt)].mean()) + (0.2 if i % 2 else -0.2)
        v1, v2, v3 = rand(H, seed=50 + i, scale=3.0), rand(H, seed=60 + i, scale=3.0), rand(H, seed=70 + i)
        specs.append(SteeringSpec(interventions=[
            When([Add(1, v1, hook="pre_attn")], 0, d1, t1, hook="post_attn"),
            Add(0, v3, select=SelectSpec(prompt="all")),
            When([Add(2, v2, select=SelectSpec(generation_window=(1, 5)))], 1, d2, t2, hook="pre_attn", scope="prompt")]))
        g1 = Gate(d1, t1, prompt_len=len(prompt))
        g2 = Gate(d2, t2, scope="prompt", prompt_len=len(prompt))
        edit_lists.append([("post_mlp", 0, add_edit(v3), SelectSpec(prompt="all")), ("post_attn", 0, g1.read(), None),
                           ("pre_attn", 1, g2.read(), None),  # a gate reads before its point's edits
                           ("pre_attn", 1, g1.gated(add_edit(v1)), None),
                           ("post_mlp", 2, g2.gated(add_edit(v2), SelectSpec(generation_window=(1, 5))), None)])
    params = [greedy(steering_vectors=specs[i]) if i < 4 else greedy() for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    never = LLM(path, device="cpu", kv_cache_tokens=16384).generate(prompts, [greedy()] * 6, use_tqdm=False)
    for i in (4, 5):
        assert outs[i].outputs[0].token_ids == never[i].outputs[0].token_ids
        assert _logprobs(outs[i]) == _logprobs(never[i])
    assert sum(outs[i].outputs[0].token_ids != never[i].outputs[0].token_ids for i in range(4)) >= 2
    for i in range(4):
        tokens, logprobs = HFSteered(hf, edit_lists[i]).greedy(prompts[i], N)
        assert outs[i].outputs[0].token_ids == tokens, i
        assert max_logprob_gap(outs[i], logprobs) <= 1e-4
    assert llm.get_steering_status()["rows_in_use"] == 0


def test_chunked_prefill_preemption_and_prefix_cache(model_dirs):
    """Gated requests under 16-token prefill chunks and under preemption give a cold engine's
    tokens. A prompt-scope gate reads every prompt row, so its request never takes a prefix-cache
    hit, while its prompt blocks (which its items do not touch) serve later plain requests; a
    token-scope gate's items touch prompt rows, so its blocks are its own."""
    path = model_dirs["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok((PROMPTS[i % 8] + " ") * 3).input_ids for i in range(10)]
    params = []
    for i in range(10):
        gate = When([Add(2, rand(H, seed=80 + i, scale=3.0))], 1, rand(H, seed=90 + i), 0.0,
                    scope="prompt" if i % 2 else "token")
        params.append(SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                     steering_vectors=SteeringSpec(interventions=[gate])) if i % 5
                      else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    check_chunked_and_preempted(path, prompts, params, kv_cache_tokens=400)
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    hits = lambda: llm.engine.stats()["prefix_cache_hit_tokens"]  # noqa: E731
    prefix = list(range(20, 84))  # four full blocks
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    by_prompt = SteeringSpec(interventions=[When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), 0.0, scope="prompt")])
    by_token = SteeringSpec(interventions=[When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), 0.0)])
    first = llm.generate([prefix + [5]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=by_prompt),
                         use_tqdm=False)[0]
    before = hits()
    llm.generate([prefix + [6]], plain, use_tqdm=False)
    assert hits() >= before + 64, "the prompt-gated request's prompt blocks are shareable"
    before = hits()
    again = llm.generate([prefix + [5]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=by_prompt),
                         use_tqdm=False)[0]
    assert hits() == before, "a prompt-scope gate reads every prompt row: no prefix-cache hit"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.generate([prefix + [7]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=by_token),
                 use_tqdm=False)
    assert hits() == before, "a token-scope gate's items touch prompt rows: no reuse of plain blocks"


def test_global_and_module_gates_equal_per_request_and_n_completions(model_dirs):
    """A When set globally, or registered as a module, steers as the same When given per request;
    the completions of one n=2 request each run the gate."""
    path = model_dirs["llama"]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    prompt = _ids(llm, PROMPTS[2])
    spec = SteeringSpec(interventions=[When([Add(2, rand(H, seed=1, scale=4.0))], 0, rand(H, seed=2), 0.0),
                                       When([Add(2, rand(H, seed=3, scale=4.0))], 1, rand(H, seed=4), 0.0,
                                            scope="prompt", compare="<")])
    inline = llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)[0]
    assert inline.outputs[0].token_ids != llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    llm.register_steering_modules({"gated": spec})
    by_module = llm.generate([prompt], greedy(steering_module_ref="gated"), use_tqdm=False)[0]
    llm.set_steering_vectors(spec)
    both = llm.generate([prompt], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, n=2), use_tqdm=False)[0]
    llm.clear_steering_vectors()
    llm.unregister_steering_modules(["gated"])
    assert by_module.outputs[0].token_ids == inline.outputs[0].token_ids
    assert [c.token_ids for c in both.outputs] == [inline.outputs[0].token_ids] * 2
    assert llm.get_steering_status()["rows_in_use"] == 0
