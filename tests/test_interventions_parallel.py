"""LowRank, Affine, When and RouterBias under tensor and pipeline parallelism (gloo, float32): the
same tokens and logprobs as one rank. On a pipeline a gate on the first stage moves rows the second
stage's edits read (each token's row travels with the residual stream), and a prompt-scope gate
keeps its decision on its own stage."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from parallel_harness import _engine, _fork_server, _hang_guard, deadline, models, single  # noqa: F401

from steerable import Add, Affine, LowRank, RouterBias, SamplingParams, SelectSpec, SteeringSpec, When

H = 64
TOKENS = 6


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _loreft(layer: int, seed: int, rank: int = 3, **kw) -> LowRank:
    R = torch.linalg.qr(_rand(H, rank, seed=seed))[0].T.contiguous()
    return LowRank(layer, R, _rand(rank, H, seed=seed + 1), _rand(rank, seed=seed + 2, scale=2.0), **kw)


def _batch(moe: bool) -> list[SamplingParams]:
    """Distinct configs: gates on layer 0 and 1 with items on layer 2 (the second stage of a
    two-stage pipeline of three layers), LoReFTs and Affines, router biases on the MoE; one
    request unsteered."""
    def params(spec):
        return SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=3, steering_vectors=spec)

    specs = [
        SteeringSpec(interventions=[_loreft(0, 1), When([Add(2, _rand(H, seed=4, scale=3.0))], 1, _rand(H, seed=5), 0.0)]),
        SteeringSpec(interventions=[When([_loreft(2, 6, hook="pre_attn"), Affine(2, (_rand(H, 2, seed=9), _rand(2, H, seed=10)))],
                                         0, _rand(H, seed=11), 0.0, hook="post_attn", scope="prompt")]),
        SteeringSpec(interventions=[Affine(1, _rand(H, H, seed=12, scale=0.1), _rand(H, seed=13), hook="post_attn",
                                           select=SelectSpec(generation="all"))]),
    ]
    if moe:
        specs.append(SteeringSpec(interventions=[RouterBias(2, 1, 5.0),
                                                 When([RouterBias(0, 3, 4.0)], 0, _rand(H, seed=14), 0.0, "pre_attn")]))
    return [params(spec) for spec in specs] + [params(None)]


def _same(outs, refs) -> None:
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    for o, r in zip(outs, refs):
        for x, y in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert set(x) == set(y) and max(abs(x[t].logprob - y[t].logprob) for t in x) <= 1e-4


@pytest.mark.parametrize("layout, family", [((1, 2), "llama"), ((2, 1), "qwen3_moe")], ids=["pp2-llama", "tp2-moe"])
def test_edits_gates_and_router_biases_match_one_rank(models, single, layout, family):
    tp, pp = layout
    params = _batch(family == "qwen3_moe")
    prompts = [PROMPTS[i] for i in range(len(params))]
    refs = single[family].generate(prompts, params, use_tqdm=False)
    unsteered = single[family].generate(prompts[:1], SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                    ignore_eos=True), use_tqdm=False)
    assert refs[0].outputs[0].token_ids != unsteered[0].outputs[0].token_ids
    with deadline():
        llm = _engine(models[family], tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=16)
    try:
        _same(llm.generate(prompts, params, use_tqdm=False), refs)
        assert llm.get_steering_status()["rows_in_use"] == 0
    finally:
        with deadline(30):
            llm.shutdown()
