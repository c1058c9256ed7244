"""LowRank (LoReFT) and Affine edits: equal to HF hooks applying their formulas on Llama, Qwen3 and
Gemma 3, alone and mixed with adds, clamps and SAE features in one batch of distinct configs;
isolation of unsteered requests; modules, global steering and scale; the JSON forms; chunked
prefill, preemption and prefix-cache identity; bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap
from intervention_oracle import check_chunked_and_preempted, affine_delta, edits_at_once, lowrank_delta, orthonormal_rows, plus, rand
from server_harness import SERVED_NAME, USER, assert_nothing_held
from test_sae_registry import random_sae
from transformers import AutoTokenizer

from steerable import (LLM, Add, Affine, Clamp, Feature, LowRank, RouterBias, SamplingParams, SelectSpec,
                       SteeringSpec, When)
from steerable.steering.wire import steering_from_json

N = 8
H = 64
FAMILIES = ["llama", "qwen3", "gemma3"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


def loreft(layer: int, seed: int, rank: int = 4, scale: float = 1.0, **kw) -> tuple[LowRank, object]:
    """A LowRank item and its HF edit function (``plus`` of LoReFT's change)."""
    R, W, b = orthonormal_rows(rank, H, seed), rand(rank, H, seed=seed + 1, scale=scale), rand(rank, seed=seed + 2,
                                                                                                scale=2 * scale)
    return LowRank(layer, R, W, b, **kw), lowrank_delta(R, W, b)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, model_dirs):
    path = model_dirs[request.param]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    yield request.param, llm, hf_model(path)
    llm.shutdown()


def _ids(llm, text):
    return llm.get_tokenizer()(text).input_ids


def _check(llm, hf, prompt_ids, steering, edits):
    """Engine with ``steering`` == HF with ``edits``, and the steering visibly changes the output."""
    out = llm.generate([prompt_ids], greedy(steering_vectors=steering), use_tqdm=False)[0]
    ref_tokens, ref_lp = HFSteered(hf, edits).greedy(prompt_ids, N)
    assert out.outputs[0].token_ids == ref_tokens
    assert max_logprob_gap(out, ref_lp) <= 1e-4
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(prompt_ids, N)
    assert plain_tokens != ref_tokens or (ref_lp - plain_lp).abs().max().item() > 0.05, "no visible effect"
    return out


@pytest.mark.parametrize("hook", ["pre_attn", "post_attn", "post_mlp", "mlp_in", "mlp_out"])
def test_lowrank_matches_hf_hook(family, hook):
    name, llm, hf = family
    scale = 3.0 if name == "gemma3" else 1.0  # Gemma's residual stream is large (embeddings scaled by sqrt(H))
    item, delta = loreft(1, 10, scale=scale, hook=hook)
    _check(llm, hf, _ids(llm, PROMPTS[1]), SteeringSpec(interventions=[item]), [(hook, 1, plus(delta), None)])


def test_affine_full_and_low_rank_match_hf_with_selections(family):
    name, llm, hf = family
    scale = 3.0 if name == "gemma3" else 1.0
    A, c = rand(H, H, seed=20, scale=0.15), rand(H, seed=21, scale=scale)
    U, V = rand(H, 3, seed=22, scale=0.5), rand(3, H, seed=23, scale=0.5)
    last, gen = SelectSpec.parse("last_prompt"), SelectSpec(generation="all")
    spec = SteeringSpec(interventions=[Affine(0, A, c, hook="post_attn", select=gen),
                                       Affine(2, (U, V), -c, hook="pre_attn", select=last)])
    edits = [("post_attn", 0, plus(affine_delta(A, c)), gen), ("pre_attn", 2, plus(affine_delta((U, V), -c)), last)]
    _check(llm, hf, _ids(llm, PROMPTS[3]), spec, edits)


def test_edits_at_one_point_read_the_stream_after_its_adds_and_clamps(family):
    """An add, a clamp, two LoReFTs and a dense Affine at one point: the add, then the clamp, then
    the edits' changes summed from the same stream (so their order does not matter)."""
    name, llm, hf = family
    scale = 3.0 if name == "gemma3" else 1.0
    v, d = rand(H, seed=30, scale=2 * scale), rand(H, seed=31)
    first, first_delta = loreft(1, 40, rank=2, scale=scale)
    second, second_delta = loreft(1, 50, rank=5, scale=scale)
    A = rand(H, H, seed=60, scale=0.1)
    spec = SteeringSpec(interventions=[second, Affine(1, A), Add(1, v), first, Clamp(1, d, min=-0.5, max=0.5)])
    edits = [("post_mlp", 1, add_edit(v), None), ("post_mlp", 1, clamp_edit(d, -0.5, 0.5), None),
             ("post_mlp", 1, edits_at_once(first_delta, second_delta, affine_delta(A)), None)]
    _check(llm, hf, _ids(llm, PROMPTS[5]), spec, edits)
    reordered = SteeringSpec(interventions=[first, Clamp(1, d, min=-0.5, max=0.5), Add(1, v), Affine(1, A), second])
    a = llm.generate([_ids(llm, PROMPTS[5])], greedy(steering_vectors=spec), use_tqdm=False)[0]
    b = llm.generate([_ids(llm, PROMPTS[5])], greedy(steering_vectors=reordered), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_edits_wider_than_the_table_fold_into_a_dense_slot(model_dirs):
    """Two rank-40 LoReFTs at one point (80 rows, over the table's 64) run as one dense matrix,
    beside a request with a narrow one at the same point: both equal HF."""
    path = model_dirs["llama"]
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    hf = hf_model(path)
    prompts = [_ids(llm, PROMPTS[1]), _ids(llm, PROMPTS[4])]
    (a, da), (b, db), (c, dc) = loreft(1, 800, rank=40, scale=0.3), loreft(1, 900, rank=40, scale=0.3), loreft(1, 950)
    outs = llm.generate(prompts, [greedy(steering_vectors=SteeringSpec(interventions=[a, b])),
                                  greedy(steering_vectors=SteeringSpec(interventions=[c]))], use_tqdm=False)
    ledger = llm.llm_engine.steering.edits
    assert ledger.dense_slots[("post_mlp", 1)] == 2 and ledger.width["edit", ("post_mlp", 1)] == 4  # folded, narrow
    for out, prompt, fn in ((outs[0], prompts[0], edits_at_once(da, db)), (outs[1], prompts[1], plus(dc))):
        tokens, logprobs = HFSteered(hf, [("post_mlp", 1, fn, None)]).greedy(prompt, N)
        assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4


def test_distinct_configs_in_one_batch_with_adds_clamps_and_features(model_dirs):
    """Twelve requests, eight with their own edits (LoReFTs of other ranks and layers, Affines,
    with adds, clamps and an SAE feature beside them), four unsteered: each steered one equals
    HF and a run of its own; each unsteered one is byte-identical to an engine that never steered."""
    path = model_dirs["qwen3"]
    llm = LLM(path, device="cpu", kv_cache_tokens=16384)
    sae = random_sae(architecture="relu", layer=1, hook="post_mlp", seed=3)
    llm.register_sae("res1", sae)
    hf = hf_model(path)
    prompts = [_ids(llm, PROMPTS[i % len(PROMPTS)]) for i in range(12)]
    specs, edits = [], []
    for i in range(8):
        item, delta = loreft(i % 3, 100 + 10 * i, rank=1 + i % 4, hook=["pre_attn", "post_attn", "post_mlp"][i % 3])
        point = item.hook
        these = [SteeringSpec(interventions=[item]), [(point, i % 3, plus(delta), None)]]
        if i % 4 == 1:
            v = rand(H, seed=200 + i, scale=2.0)
            these[0].interventions.append(Add(2, v))
            these[1].insert(0, ("post_mlp", 2, add_edit(v), None))  # adds come before edits at a point
        elif i % 4 == 2:
            d = rand(H, seed=300 + i)
            these[0].interventions.append(Clamp(0, d, hook="post_attn", min=0.0, max=0.0))
            these[1].insert(0, ("post_attn", 0, clamp_edit(d, 0.0, 0.0), None))
        elif i % 4 == 3:
            these[0].features = [Feature("res1", 7, scale=4.0)]
            these[1].insert(0, ("post_mlp", 1, add_edit(4.0 * sae.W_dec[7]), None))
        if i % 2:
            A, c = rand(H, H, seed=400 + i, scale=0.1), rand(H, seed=500 + i)
            these[0].interventions.append(Affine(2, A, c, hook="pre_attn"))
            these[1].append(("pre_attn", 2, plus(affine_delta(A, c)), None))
        specs.append(these[0])
        edits.append(these[1])
    params = [greedy(steering_vectors=specs[i]) if i < 8 else greedy() for i in range(12)]
    order = [0, 8, 1, 2, 9, 3, 4, 10, 5, 6, 11, 7]  # steered and unsteered interleaved
    outs = dict(zip(order, llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)))
    status = llm.get_steering_status()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0
    # The same batch on an engine that never steered (CPU logprobs depend on the batch's shapes, not its steering).
    never = LLM(path, device="cpu", kv_cache_tokens=16384)
    plain = dict(zip(order, never.generate([prompts[i] for i in order], [greedy()] * 12, use_tqdm=False)))
    for i in range(8, 12):
        assert outs[i].outputs[0].token_ids == plain[i].outputs[0].token_ids
        assert _logprobs(outs[i]) == _logprobs(plain[i])
    for i in range(8):
        alone = llm.generate([prompts[i]], params[i], use_tqdm=False)[0]
        assert outs[i].outputs[0].token_ids == alone.outputs[0].token_ids
        ref_tokens, ref_lp = HFSteered(hf, edits[i]).greedy(prompts[i], N)
        assert outs[i].outputs[0].token_ids == ref_tokens, i
        assert max_logprob_gap(outs[i], ref_lp) <= 1e-4


def test_modules_global_scale_and_readback(model_dirs):
    """A module of edits: scale 0 is byte-identical to no steering, scale s scales what the edits
    write; the module reads back (``get_steering_module``) as items with the same effect; global
    edits compose with the module's."""
    path = model_dirs["llama"]
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    hf = hf_model(path)
    prompt = _ids(llm, PROMPTS[1])
    item, delta = loreft(1, 70)
    A, c = rand(H, H, seed=71, scale=0.1), rand(H, seed=72)
    llm.register_steering_modules({"edits": SteeringSpec(interventions=[item, Affine(0, A, c, hook="post_attn")])})
    plain = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    zero = llm.generate([prompt], greedy(steering_module_ref=("edits", 0.0)), use_tqdm=False)[0]
    assert zero.outputs[0].token_ids == plain.outputs[0].token_ids
    assert [e.keys() for e in zero.outputs[0].logprobs] == [e.keys() for e in plain.outputs[0].logprobs]
    half = llm.generate([prompt], greedy(steering_module_ref=("edits", 0.5)), use_tqdm=False)[0]
    ref_tokens, ref_lp = HFSteered(hf, [("post_attn", 0, lambda h: h + 0.5 * affine_delta(A, c)(h), None),
                                        ("post_mlp", 1, lambda h: h + 0.5 * delta(h), None)]).greedy(prompt, N)
    assert half.outputs[0].token_ids == ref_tokens and max_logprob_gap(half, ref_lp) <= 1e-4
    readback = llm.get_steering_module("edits")
    assert {type(i) for i in readback.interventions} == {Affine}
    again = llm.generate([prompt], greedy(steering_vectors=readback), use_tqdm=False)[0]
    full = llm.generate([prompt], greedy(steering_module_ref="edits"), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == full.outputs[0].token_ids
    assert max_logprob_gap(again, torch.stack([_row(e) for e in full.outputs[0].logprobs])) <= 1e-4
    llm.set_steering_vectors(SteeringSpec(interventions=[item]))
    status = llm.get_steering_status()
    assert status["global"]["edits"] == 1 and status["modules"]["edits"]["edits"] == 2
    both = llm.generate([prompt], greedy(steering_module_ref="edits"), use_tqdm=False)[0]
    ref_tokens, _ = HFSteered(hf, [("post_attn", 0, plus(affine_delta(A, c)), None),
                                   ("post_mlp", 1, edits_at_once(delta, delta), None)]).greedy(prompt, N)
    assert both.outputs[0].token_ids == ref_tokens
    llm.clear_steering_vectors()
    llm.unregister_steering_modules(["edits"])
    assert llm.get_steering_status()["rows_in_use"] == 0


def _logprobs(out) -> list[dict[int, float]]:
    return [{t: lp.logprob for t, lp in entry.items()} for entry in out.outputs[0].logprobs]


def _row(entry) -> torch.Tensor:
    """A logprob entry as a dense row (missing tokens at -inf), for ``max_logprob_gap``."""
    row = torch.full((1024,), -float("inf"))
    for token, lp in entry.items():
        row[token] = lp.logprob
    return row


@pytest.mark.parametrize("encoding", ["list", "base64"])
def test_json_forms_round_trip(model_dirs, encoding):
    """Every new item through ``to_dict`` / ``from_dict`` (and the server's ``steering_from_json``)
    steers exactly as the Python objects do."""
    llm = LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=4096)
    item, _ = loreft(1, 80, rank=3, select=SelectSpec(prompt="all"))
    spec = SteeringSpec(interventions=[
        item, Affine(0, rand(H, H, seed=81, scale=0.1), rand(H, seed=82)),
        Affine(2, (rand(H, 2, seed=83), rand(2, H, seed=84)), None, hook="pre_attn"),
        When([Add(2, rand(H, seed=85, scale=3.0))], 1, rand(H, seed=86), 0.1, scope="prompt", compare="<")])
    data = spec.to_dict(encoding)
    assert [i["type"] for i in data["interventions"]] == ["lowrank", "affine", "affine", "when"]
    prompt = _ids(llm, PROMPTS[0])
    ref = llm.generate([prompt], greedy(steering_vectors=spec), use_tqdm=False)[0]
    for form in (SteeringSpec.from_dict(data), steering_from_json(data)):
        out = llm.generate([prompt], greedy(steering_vectors=form), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    by_feature = SteeringSpec(interventions=[When([Add(2, [1.0] * H)], 1, Feature("res1", 5), 0.5, compare="<")])
    back = SteeringSpec.from_dict(by_feature.to_dict(encoding)).interventions[0]
    assert back.direction == Feature("res1", 5) and back.compare == "<" and back.threshold == 0.5
    moe = {"interventions": [{"type": "router_bias", "layer": 2, "expert": 3, "bias": 1.5}]}
    assert SteeringSpec.from_dict(moe).interventions == [RouterBias(2, 3, 1.5)]
    assert SteeringSpec.from_dict(moe).to_dict() == moe


def test_chunked_prefill_preemption_and_prefix_cache(model_dirs):
    """Edits under prefill chunks of 16 tokens and under preemption give a cold engine's tokens; a
    prompt-edited request never reuses KV computed without it, a decode-only one shares it."""
    path = model_dirs["qwen3"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok((PROMPTS[i % 8] + " ") * 3).input_ids for i in range(10)]
    params = []
    for i in range(10):
        item, _ = loreft(i % 3, 600 + 10 * i, rank=2, select=[None, SelectSpec(prompt_positions=[-1, -4]),
                                                              SelectSpec(generation="all")][i % 3])
        params.append(SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, steering_vectors=SteeringSpec(
            interventions=[item, Affine(1, (rand(H, 2, seed=i), rand(2, H, seed=50 + i)), hook="post_attn")]))
            if i % 4 else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    check_chunked_and_preempted(path, prompts, params, kv_cache_tokens=400)
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    hits = lambda: llm.engine.stats()["prefix_cache_hit_tokens"]  # noqa: E731
    prefix = list(range(20, 84))  # four full blocks
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate([prefix + [5]], plain, use_tqdm=False)
    before = hits()
    item, _ = loreft(1, 700)
    llm.generate([prefix + [6]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=SteeringSpec(
        interventions=[item])), use_tqdm=False)
    assert hits() == before, "a prompt-edited request must not reuse unsteered prompt blocks"
    other, _ = loreft(1, 710)
    llm.generate([prefix + [7]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=SteeringSpec(
        interventions=[other])), use_tqdm=False)
    assert hits() == before, "nor blocks computed under another edit"
    decode_only, _ = loreft(1, 700, select=SelectSpec(generation="all"))
    llm.generate([prefix + [8]], SamplingParams(max_tokens=3, temperature=0, steering_vectors=SteeringSpec(
        interventions=[decode_only])), use_tqdm=False)
    assert hits() >= before + 64


R_BAD = orthonormal_rows(4, H, 1) * 1.1


@pytest.mark.parametrize("item, field, words", [
    (LowRank(1, R_BAD, rand(4, H, seed=1), rand(4, seed=2)), "interventions[0].R", "not orthonormal (max |R R^T - I| = 0.21"),
    (LowRank(1, orthonormal_rows(4, 32, 1), rand(4, 32, seed=1), rand(4, seed=2)), "interventions[0].R", "[r, 64]"),
    (LowRank(1, orthonormal_rows(4, H, 1), rand(3, H, seed=1), rand(4, seed=2)), "interventions[0].W", "[4, 64]"),
    (LowRank(1, orthonormal_rows(4, H, 1), rand(4, H, seed=1), rand(5, seed=2)), "interventions[0].b", "[4]"),
    (LowRank(1, torch.zeros(0, H), torch.zeros(0, H), torch.zeros(0)), "interventions[0].R", "rank 0"),
    (LowRank(3, orthonormal_rows(4, H, 1), rand(4, H, seed=1)), "interventions[0].layer", "layer index"),
    (LowRank(1, orthonormal_rows(4, H, 1), rand(4, H, seed=1), hook="mlp"), "interventions[0].hook", "unknown hook"),
    (Affine(1, rand(H, H - 1, seed=1)), "interventions[0].A", "[64, 64]"),
    (Affine(1, (rand(H, 2, seed=1), rand(3, H, seed=2))), "interventions[0].A.V", "[2, 64]"),
    (Affine(1, (torch.zeros(H, 0), torch.zeros(0, H))), "interventions[0].A.U", "rank 0"),
    (Affine(1, torch.full((H, H), float("nan"))), "interventions[0].A", "NaN"),
    (Affine(1, rand(H, H, seed=1), rand(H + 1, seed=2)), "interventions[0].c", "[64]"),
    (When([Add(0, rand(H, seed=1))], 1, rand(H, seed=2), 0.0), "interventions[0].items[0].layer", "before the gate"),
    (When([Add(1, rand(H, seed=1), hook="post_attn")], 1, rand(H, seed=2), 0.0), "items[0].layer", "before the gate"),
    (When([Add(2, rand(H, seed=1))], 1, torch.zeros(H), 0.0), "interventions[0].direction", "zero vector"),
    (When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), 0.0, scope="request"), "interventions[0].scope", "token"),
    (When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), 0.0, compare=">="), "interventions[0].compare", "'<'"),
    (When([], 1, rand(H, seed=2), 0.0), "interventions[0].items", "non-empty"),
    (When([When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), 0.0)], 1, rand(H, seed=2), 0.0),
     "interventions[0].items[0]", "cannot hold another When"),
    (When([Add(2, rand(H, seed=1))], 1, rand(H, seed=2), float("inf")), "interventions[0].threshold", "finite"),
    (When([Add(2, rand(H, seed=1))], 1, Feature("ghost", 1), 0.0), "interventions[0].direction.sae", "ghost"),
    (RouterBias(1, 0, 2.0), "interventions[0].layer", "this model is dense"),
])
def test_bad_input_names_the_field_and_leaks_nothing(model_dirs, item, field, words):
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError) as err:
        llm.generate(["hello"], SamplingParams(max_tokens=2, steering_vectors=SteeringSpec(interventions=[item])),
                     use_tqdm=False)
    assert f"steering_vectors.{field}" in str(err.value) or field in str(err.value), str(err.value)
    assert words in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="modules"):
        llm.register_steering_modules({"bad": SteeringSpec(interventions=[item])})
    status = llm.get_steering_status()
    assert status["rows_in_use"] == 0 and status["configs_in_use"] == 0 and not status["modules"]
    assert llm.llm_engine.stats()["num_requests"] == 0
    good = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(good.outputs[0].token_ids) == 3


def test_http_steering_vectors_with_edits(http, offline):
    """The server takes the JSON forms in ``steering_vectors`` (the output equals the engine in
    this process) and answers bad ones with a 400 naming the field."""
    item, _ = loreft(1, 90, rank=2)
    spec = SteeringSpec(interventions=[item, When([Affine(2, rand(H, H, seed=91, scale=0.1))], 1, rand(H, seed=92),
                                                  0.0)])
    body = {"model": SERVED_NAME, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
            "steering_vectors": spec.to_dict("base64")}
    reply = http.post("/v1/completions", json=body, headers=USER)
    assert reply.status_code == 200, reply.text
    want = offline.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, steering_vectors=spec),
                            use_tqdm=False)[0].outputs[0].text
    assert reply.json()["choices"][0]["text"] == want
    bad = spec.to_dict()
    bad["interventions"][0]["R"] = [row[:10] for row in bad["interventions"][0]["R"]]
    reply = http.post("/v1/completions", json={**body, "steering_vectors": bad}, headers=USER)
    assert reply.status_code == 400
    assert "steering_vectors.interventions[0].R" in reply.json()["error"]["message"]
    assert http.post("/v1/completions", json={**body, "steering_vectors": None}, headers=USER).status_code == 200
    assert_nothing_held(http)


@pytest.mark.parametrize("item, field, words", [
    ({"type": "lowrank", "layer": 1, "R": [[1.0, 2.0], [3.0]], "W": [[0.0]]}, "interventions[0].R", "one length"),
    ({"type": "lowrank", "layer": 1, "R": {"dtype": "float32", "shape": [4], "data": ""}, "W": [[0.0]]},
     "interventions[0].R.shape", "[rows, cols]"),
    ({"type": "lowrank", "layer": 1, "W": [[0.0]]}, "interventions[0]", "missing ['R']"),
    ({"type": "affine", "layer": 1, "A": [[0.0]], "U": [[0.0]]}, "interventions[0].A", "either A"),
    ({"type": "when", "items": [], "direction": [0.0], "threshold": 0, "gate": 1}, "interventions[0].gate",
     "unknown key"),
    ({"type": "when", "items": {}, "direction": [0.0], "threshold": 0}, "interventions[0].items", "a list"),
    ({"type": "router_bias", "layer": 1, "expert": 0}, "interventions[0]", "missing ['bias']"),
    ({"type": "loreft", "layer": 1}, "interventions[0].type", "'lowrank'"),
])
def test_bad_json_names_the_field(item, field, words):
    with pytest.raises(ValueError) as err:
        steering_from_json({"interventions": [item]})
    assert f"steering_vectors.{field}" in str(err.value) and words in str(err.value), str(err.value)
