"""MoE router steering (``RouterBias``) on Qwen3-MoE: equal to HF with the bias added to the router
logits before softmax and top-k; the router-logit capture shows it; mixed with LoReFTs and gated by
a ``When`` in one batch of distinct configs; bad input (a dense layer or model, an expert out of
range)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, max_logprob_gap
from intervention_oracle import check_chunked_and_preempted, Gate, lowrank_delta, orthonormal_rows, patch_router, plus, rand
from test_qwen3_moe import build_qwen3_moe

from steerable import LLM, CaptureSpec, LowRank, RouterBias, SamplingParams, SteeringSpec, When
from steerable.capture import ROUTER_LOGITS

N = 8
H = 64
EXPERTS = 8


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=5, **kw)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Layers 0 and 2 sparse (8 experts, top 2), layer 1 dense."""
    path = str(tmp_path_factory.mktemp("router_bias") / "moe")
    build_qwen3_moe(path, seed=8, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True)
    llm = LLM(path, device="cpu", kv_cache_tokens=8192)
    yield llm, hf_model(path), path
    llm.shutdown()


def _ids(llm, text):
    return llm.get_tokenizer()(text).input_ids


def _bias(**experts: float) -> torch.Tensor:
    bias = torch.zeros(EXPERTS)
    for expert, value in experts.items():
        bias[int(expert.removeprefix("e"))] = value
    return bias


def test_router_bias_matches_hf_and_shows_in_router_capture(moe):
    llm, hf, _ = moe
    prompt = _ids(llm, PROMPTS[1])
    spec = SteeringSpec(interventions=[RouterBias(0, 5, 3.0), RouterBias(2, 1, 4.0), RouterBias(2, 6, -2.0)])
    undo = [patch_router(hf, 0, _bias(e5=3.0)), patch_router(hf, 2, _bias(e1=4.0, e6=-2.0))]
    try:
        tokens, logprobs = HFSteered(hf, []).greedy(prompt, N)
    finally:
        for u in undo:
            u()
    capture = CaptureSpec(ROUTER_LOGITS)
    out = llm.generate([prompt], greedy(steering_vectors=spec, capture=capture), use_tqdm=False)[0]
    plain = llm.generate([prompt], greedy(capture=capture), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert out.outputs[0].token_ids != plain.outputs[0].token_ids
    steered, unsteered = out.captures[ROUTER_LOGITS], plain.captures[ROUTER_LOGITS]
    prompt_rows = len(prompt)  # rows before the first generated one saw the same stream in both runs
    assert torch.allclose(steered[0][:prompt_rows], unsteered[0][:prompt_rows] + _bias(e5=3.0), atol=1e-5)
    assert (steered[0].topk(2).indices == 5).any(-1).float().mean() > (unsteered[0].topk(2).indices == 5).any(-1).float().mean()


def test_router_bias_mixed_and_gated_in_one_batch(moe):
    """Distinct configs: router biases alone, with a LoReFT, and under a token gate; an unsteered
    request stays byte-identical to a batch without steering."""
    llm, hf, path = moe
    prompts = [_ids(llm, PROMPTS[i]) for i in range(4)]
    d = rand(H, seed=3)
    R, W, b = orthonormal_rows(2, H, 4), rand(2, H, seed=5), rand(2, seed=6)
    specs = [SteeringSpec(interventions=[RouterBias(2, 3, 5.0)]),
             SteeringSpec(interventions=[RouterBias(0, 7, 4.0), LowRank(1, R, W, b, hook="post_attn")]),
             SteeringSpec(interventions=[When([RouterBias(2, 0, 6.0)], 1, d, 0.0)])]
    outs = llm.generate(prompts, [greedy(steering_vectors=s) for s in specs] + [greedy()], use_tqdm=False)
    never = LLM(path, device="cpu", kv_cache_tokens=8192).generate(
        prompts, [greedy()] * 4, use_tqdm=False)
    # Tokens identical; logprobs to rounding only: the CPU expert loop groups a step's tokens by
    # expert, so a biased request's routing changes the row count of the unsteered one's GEMMs.
    assert outs[3].outputs[0].token_ids == never[3].outputs[0].token_ids
    assert max_logprob_gap(outs[3], torch.stack([_row(e) for e in never[3].outputs[0].logprobs])) <= 1e-5
    gate = Gate(d, 0.0, prompt_len=len(prompts[2]))
    references = [({2: _bias(e3=5.0)}, []),
                  ({0: _bias(e7=4.0)}, [("post_attn", 1, plus(lowrank_delta(R, W, b)), None)]),
                  ({}, [("post_mlp", 1, gate.read(), None)])]
    for i, (biases, edits) in enumerate(references):
        undo = [patch_router(hf, layer, bias) for layer, bias in biases.items()]
        if i == 2:  # the gated bias: per row, by the gate's reading at post_mlp 1 (before layer 2's router)
            undo.append(_patch_gated_router(hf, 2, _bias(e0=6.0), gate))
        try:
            tokens, logprobs = HFSteered(hf, edits).greedy(prompts[i], N)
        finally:
            for u in undo:
                u()
        assert outs[i].outputs[0].token_ids == tokens, i
        assert max_logprob_gap(outs[i], logprobs) <= 1e-4
    assert gate.mask.any() and not gate.mask.all(), "the gate must pass some rows and not others"
    assert llm.get_steering_status()["rows_in_use"] == 0


def _row(entry) -> torch.Tensor:
    row = torch.full((1024,), -float("inf"))
    for token, lp in entry.items():
        row[token] = lp.logprob
    return row


def _patch_gated_router(model, layer: int, bias: torch.Tensor, gate: Gate):
    """The router bias on the rows where ``gate`` passed (its mask is set earlier in the forward)."""
    router = model.model.layers[layer].mlp.gate
    original = router.forward

    def forward(hidden_states):
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, router.weight)
        logits = torch.where(gate.mask[:, None], logits + bias, logits)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, indices = torch.topk(probs, router.top_k, dim=-1)
        top /= top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), indices

    router.forward = forward
    return lambda: setattr(router, "forward", original)


@pytest.mark.parametrize("item, field, words", [
    (RouterBias(1, 0, 1.0), "interventions[0].layer", "layer 1 has no router (mixture-of-experts layers: [0, 2])"),
    (RouterBias(2, EXPERTS, 1.0), "interventions[0].expert", "not an expert index in [0, 8)"),
    (RouterBias(2, -1, 1.0), "interventions[0].expert", "not an expert index"),
    (RouterBias(2, 1, float("nan")), "interventions[0].bias", "finite"),
    (RouterBias(5, 1, 1.0), "interventions[0].layer", "layer index in [0, 3)"),
])
def test_bad_router_bias(moe, item, field, words):
    llm = moe[0]
    with pytest.raises(ValueError) as err:
        llm.generate(["hello"], SamplingParams(max_tokens=2, steering_vectors=SteeringSpec(interventions=[item])),
                     use_tqdm=False)
    assert f"steering_vectors.{field}" in str(err.value) and words in str(err.value), str(err.value)
    assert llm.get_steering_status()["rows_in_use"] == 0 and llm.llm_engine.stats()["num_requests"] == 0
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_chunked_prefill_and_preemption(moe):
    """Router biases (one gated) under 16-token prefill chunks and under preemption: a cold
    engine's tokens."""
    _, _, path = moe
    tok = moe[0].get_tokenizer()
    prompts = [tok((PROMPTS[i % 8] + " ") * 3).input_ids for i in range(8)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, steering_vectors=SteeringSpec(
        interventions=[RouterBias(2, i % EXPERTS, 4.0), When([RouterBias(0, (i + 3) % EXPERTS, 3.0)], 0, rand(H, seed=i),
                                                               0.0, "pre_attn")])) if i % 3
              else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for i in range(8)]
    check_chunked_and_preempted(path, prompts, params, kv_cache_tokens=320)
