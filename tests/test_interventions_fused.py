"""Edits, gates and router biases on the GPU model path without a GPU (Triton's CPU interpreter,
``TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1``): a site with an edit or a gate runs on its own
(the standalone steering kernel for its adds, then the edit), the fused add + steering + norm
kernels read each token's row after the gates, the fused MoE routing takes the biased logits; all
equal HF with the same edits."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET or os.environ.get("STEERABLE_FUSED_ON_CPU") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1", allow_module_level=True)

from conftest import hf_model  # noqa: E402
from hf_oracle import HFSteered, add_edit, max_logprob_gap  # noqa: E402
from intervention_oracle import Gate, lowrank_delta, orthonormal_rows, patch_router, plus, rand  # noqa: E402

from steerable import LLM, Add, LowRank, RouterBias, SamplingParams, SteeringSpec, When  # noqa: E402
from steerable.layers import fused  # noqa: E402

pytestmark = pytest.mark.triton
H = 64


def test_fused_path_edits_and_gates_equal_hf(capture_dirs, monkeypatch):
    """A LoReFT at post_attn 0, a token gate at post_mlp 0 gating adds at pre_attn 1 (a site the
    fused norm steers, with the rows after the gate) and post_mlp 2, and an add the fused norm
    applies before the gate."""
    norms = []  # how many sites' writes each fused add + norm kernel applied
    real = fused._add_norm
    monkeypatch.setattr(fused, "_add_norm", lambda r, d, writes, *a: norms.append(len(writes)) or real(r, d, writes, *a))
    assert fused.enabled(torch.zeros(1))
    path = capture_dirs["llama"]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=8)
    hf = hf_model(path)
    prompt = llm.get_tokenizer()("Steering vectors shift the residual stream").input_ids
    R, W, b = orthonormal_rows(3, H, 1), rand(3, H, seed=2, scale=2.0), rand(3, seed=3)
    d, v1, v2, v0 = rand(H, seed=4), rand(H, seed=5, scale=2.0), rand(H, seed=6, scale=2.0), rand(H, seed=7)
    capture = {}
    HFSteered(hf, []).forward(torch.tensor([prompt]), len(prompt), capture=capture)
    threshold = float(Gate(d).value(capture[("post_mlp", 0)]).median()) + 1e-3
    spec = SteeringSpec(interventions=[LowRank(0, R, W, b, hook="post_attn"), Add(1, v0, hook="post_attn"),
                                       When([Add(1, v1, hook="pre_attn"), Add(2, v2)], 0, d, threshold)])
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3,
                                                steering_vectors=spec), use_tqdm=False)[0]
    gate = Gate(d, threshold, prompt_len=len(prompt))
    edits = [("post_attn", 0, plus(lowrank_delta(R, W, b)), None), ("post_attn", 1, add_edit(v0), None),
             ("post_mlp", 0, gate.read(), None), ("pre_attn", 1, gate.gated(add_edit(v1)), None),
             ("post_mlp", 2, gate.gated(add_edit(v2)), None)]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, 5)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    assert gate.mask.any() and not gate.mask.all()
    assert any(n > 0 for n in norms)  # some steered sites ran inside the fused norm


def test_fused_moe_routing_takes_the_router_bias(tmp_path):
    from test_qwen3_moe import build_qwen3_moe

    path = str(tmp_path / "moe")
    build_qwen3_moe(path, seed=7, num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=4)
    hf = hf_model(path)
    prompt = llm.get_tokenizer()("Paged attention stores keys").input_ids
    bias = torch.zeros(8)
    bias[2] = 5.0
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2,
                                                steering_vectors=SteeringSpec(interventions=[RouterBias(1, 2, 5.0)])),
                       use_tqdm=False)[0]
    undo = patch_router(hf, 1, bias)
    try:
        tokens, logprobs = HFSteered(hf, []).greedy(prompt, 4)
    finally:
        undo()
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
