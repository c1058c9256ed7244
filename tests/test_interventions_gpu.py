"""GPU: LowRank, Affine, When and RouterBias inside CUDA graphs. Float32 on CUDA equals HF with the
same edits; in bfloat16 a mixed batch of distinct configs (edits, token and prompt gates, router
biases, adds and clamps, unsteered requests) replays graphs (no step forced eager) and equals the
same batch run eagerly, bit for bit."""

import random

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, max_logprob_gap
from intervention_oracle import Gate, lowrank_delta, orthonormal_rows, plus, rand

from steerable import (LLM, Add, Affine, CaptureSpec, Clamp, LowRank, RouterBias, SamplingParams, SelectSpec,
                       SteeringSpec, When)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
H = 64


def _loreft(layer: int, seed: int, rank: int = 4, **kw) -> LowRank:
    return LowRank(layer, orthonormal_rows(rank, H, seed), rand(rank, H, seed=seed + 1), rand(rank, seed=seed + 2), **kw)


def _config(i: int, moe: bool) -> SteeringSpec | None:
    """Request i's own config (every fourth request unsteered)."""
    kind = i % 4
    if kind == 0:
        return None
    if kind == 1:
        return SteeringSpec(interventions=[_loreft(i % 3, 10 * i, hook=["pre_attn", "post_attn", "post_mlp"][i % 3]),
                                           Add(2, rand(H, seed=i, scale=0.5)),
                                           Clamp(1, rand(H, seed=i + 1), min=-0.5, max=0.5)])
    if kind == 2:
        items = [Affine(1, rand(H, H, seed=i, scale=0.05), rand(H, seed=i + 1, scale=0.2), hook="post_attn",
                        select=SelectSpec(generation="all")),
                 When([Add(2, rand(H, seed=i + 2))], 0, rand(H, seed=i + 3), 0.0)]
        return SteeringSpec(interventions=items + ([RouterBias(2, i % 8, 3.0)] if moe else []))
    return SteeringSpec(interventions=[When([_loreft(2, 10 * i), Affine(2, (rand(H, 2, seed=i), rand(2, H, seed=i + 1)))],
                                            1, rand(H, seed=i + 4), 0.0, scope="prompt")])


def test_float32_on_cuda_equals_hf(model_dirs):
    path = model_dirs["qwen3"]
    llm = LLM(path, dtype="float32", device="cuda", kv_cache_tokens=8192)
    hf = hf_model(path)
    prompt = llm.get_tokenizer()(PROMPTS[5]).input_ids
    R, W, b = orthonormal_rows(3, H, 1), rand(3, H, seed=2), rand(3, seed=3, scale=2.0)
    d, v = rand(H, seed=4), rand(H, seed=5, scale=3.0)
    spec = SteeringSpec(interventions=[LowRank(1, R, W, b, hook="post_attn"), When([Add(2, v)], 1, d, 0.0)])
    gate = Gate(d, 0.0, prompt_len=len(prompt))
    edits = [("post_attn", 1, plus(lowrank_delta(R, W, b)), None), ("post_mlp", 1, gate.read(), None),
             ("post_mlp", 2, gate.gated(add_edit(v)), None)]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3,
                                                steering_vectors=spec), use_tqdm=False)[0]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, 10)
    assert out.outputs[0].token_ids == tokens and max_logprob_gap(out, logprobs) <= 1e-4
    assert llm.llm_engine.stats()["graph_replays"] > 0


def _mixed_batch(path: str, moe: bool, eager: bool):
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(5, 60))] for _ in range(24)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, steering_vectors=_config(i, moe),
                             capture=CaptureSpec(layers=[2], select="all_generated") if i % 5 == 0 else None)
              for i in range(24)]
    llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_tokens=16384, enforce_eager=eager)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_steering_status()["rows_in_use"] == 0
    return outs, llm.llm_engine.stats()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_graph_replay_equals_eager_bit_for_bit(model_dirs, tmp_path, family):
    if family == "qwen3_moe":
        from test_qwen3_moe import build_qwen3_moe

        path = str(tmp_path / "moe")
        build_qwen3_moe(path, seed=3, num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
                        norm_topk_prob=True)
    else:
        path = model_dirs[family]
    eager, eager_stats = _mixed_batch(path, family == "qwen3_moe", True)
    graphed, stats = _mixed_batch(path, family == "qwen3_moe", False)
    assert eager_stats["graph_replays"] == 0 and stats["graph_replays"] > 0
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for layer, rows in a.captures.get("hidden_states", {}).items():
            assert torch.equal(rows, b.captures["hidden_states"][layer])
