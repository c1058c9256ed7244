"""The GPU model path on a machine without a GPU: under Triton's CPU interpreter
(``TRITON_INTERPRET=1``) with ``STEERABLE_FUSED_ON_CPU=1``, a tiny model runs the fused kernels
(add + steering + RMSNorm, q/k-norm + RoPE + KV write, SwiGLU, the Gumbel sampler) and the Triton
paged attention, and must still equal HF with the same edits. CI runs this in its interpreter pass."""

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET or os.environ.get("STEERABLE_FUSED_ON_CPU") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 STEERABLE_FUSED_ON_CPU=1", allow_module_level=True)

from conftest import hf_model  # noqa: E402
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap  # noqa: E402

from steerable import LLM, CaptureSpec, Clamp, SamplingParams, SelectSpec, SteeringSpec  # noqa: E402
from steerable.layers import fused, gemv, logit_kernels  # noqa: E402

pytestmark = pytest.mark.triton


def _vec(seed, scale=1.0):
    return (torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


# Gemma 2: the soft-capped attention kernel; GPT-2: the LayerNorm kernels. (OLMo-2 and Phi-3 run the
# kernels Llama does, OLMo-2 its q/k norm in PyTorch, GPT-NeoX GPT-2's; each takes a minute under the interpreter.)
@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "gemma2", "gpt2"])
def test_fused_path_equals_hf_with_steering_and_capture(capture_dirs, family, monkeypatch):
    assert fused.enabled(torch.zeros(1))  # the switch is on: CPU tensors take the fused kernels
    one_row = []  # projections that took the one-row GEMV kernel (every batch-1 decode step's)
    real_gemv = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda *args: one_row.append(args[1].shape) or real_gemv(*args))
    path = capture_dirs[family]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=8)
    hf = hf_model(path)
    prompt = llm.get_tokenizer()("Steering vectors shift the residual stream").input_ids
    add, clamp_dir, decode, ablate = _vec(1, 2.0), _vec(2), _vec(3, 2.0), _vec(4)
    # An add at post_mlp 0 and the clamp at post_attn 1 fuse into the next norm; the ablation at
    # pre_attn 1 comes after the capture reads post_mlp 0, so layer 1's entry runs each site on its
    # own (the standalone steering kernel); a decode-only add at pre_attn 2 fuses with its selection.
    spec = SteeringSpec(vectors={"post_mlp": {0: add}},
                        clamps=[Clamp(1, clamp_dir, hook="post_attn", min=-0.2, max=0.2),
                                Clamp(1, ablate, hook="pre_attn", min=0.0, max=0.0)],
                        decode_vectors={"pre_attn": {2: decode}})
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, steering_vectors=spec,
                            capture=CaptureSpec(layers=[0, 2], select="all"))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    edits = [("post_mlp", 0, add_edit(add), None), ("post_attn", 1, clamp_edit(clamp_dir, -0.2, 0.2), None),
             ("pre_attn", 1, clamp_edit(ablate, 0.0, 0.0), None),
             ("pre_attn", 2, add_edit(decode), SelectSpec(generation="all"))]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, 5)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    assert one_row  # the decode steps above (one request) ran their projections through the GEMV
    ids = prompt + tokens
    captured = {}
    HFSteered(hf, edits).forward(torch.tensor([ids]), len(prompt), capture=captured)
    for layer in (0, 2):
        rows = out.captures["hidden_states"][layer]
        assert rows.shape[0] == len(ids) - 1
        assert (rows - captured[("post_mlp", layer)][:len(ids) - 1]).abs().max() <= 1e-4
    plain = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != tokens  # the steering had an effect


def test_fused_path_feature_steering_equals_hf(model_dirs, monkeypatch):
    """Feature adds and clamps in the fused norm (a split site holding a projection clamp too) and
    in the standalone kernel (a capture reads between two writing sites) equal HF's hooks."""
    from test_sae_registry import random_sae
    from test_sae_steering import feature_clamp_edit

    from steerable import Feature, FeatureClamp

    split = []  # the SPLIT flag of every site the kernels steered
    real_site_args = fused._site_args
    monkeypatch.setattr(fused, "_site_args", lambda *a: (lambda r: split.append(r[3]) or r)(real_site_args(*a)))
    path = model_dirs["gemma3"]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=8)
    hf = hf_model(path)
    saes = {"j": random_sae(layer=0, hook="post_mlp", apply_b_dec_to_input=True, seed=1),
            "t": random_sae(architecture="topk", layer=1, hook="post_attn", seed=2),
            "r": random_sae(architecture="relu", layer=1, hook="pre_attn", seed=3)}
    for name, sae in saes.items():
        llm.register_sae(name, sae)
    prompt = llm.get_tokenizer()("Steering vectors shift the residual stream").input_ids
    proj = _vec(5)
    spec = SteeringSpec(clamps=[Clamp(1, proj, hook="post_attn", min=-0.2, max=0.2)],
                        features=[Feature("j", 4, scale=2.0), FeatureClamp("j", 7, value=3.0),
                                  FeatureClamp("t", 11, value=0.0), FeatureClamp("r", 20, value=2.0)])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, steering_vectors=spec,
                            capture=CaptureSpec(layers=[0], select="all"))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    edits = [("post_mlp", 0, add_edit(2.0 * saes["j"].W_dec[4]), None),
             ("post_mlp", 0, feature_clamp_edit(saes["j"], 7, 3.0), None),
             ("pre_attn", 1, feature_clamp_edit(saes["r"], 20, 2.0), None),
             ("post_attn", 1, clamp_edit(proj, -0.2, 0.2), None),
             ("post_attn", 1, feature_clamp_edit(saes["t"], 11, 0.0), None)]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, 5)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    assert any(split)  # the kernels took the feature-clamp path
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(prompt, 5)
    assert plain_tokens != tokens or (plain_lp - logprobs).abs().max() > 0.05  # the steering had an effect


def test_fused_sampler_is_seeded_and_batch_independent(capture_dirs):
    llm = LLM(capture_dirs["qwen3"], device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton",
              max_num_seqs=8)
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    alone = llm.generate(["Hello world"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(["Paged attention", "Hello world"], [SamplingParams(max_tokens=4, temperature=0.7), seeded],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_qwen3_moe_fused_experts_equal_hf(tmp_path):
    """The static-shape expert dispatch (what CUDA graphs replay) in a model: greedy tokens, logprobs
    and router logits equal HF, with a clamp fused into a norm."""
    from test_qwen3_moe import build_qwen3_moe

    path = str(tmp_path / "moe")
    build_qwen3_moe(path, seed=7, num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=1, norm_topk_prob=True)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=4)
    hf = hf_model(path)
    prompt = llm.get_tokenizer()("Paged attention stores keys").input_ids
    direction = _vec(5)
    spec = SteeringSpec(clamps=[Clamp(0, direction, hook="post_attn", min=-0.1, max=0.1)])
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2,
                                                steering_vectors=spec, capture=CaptureSpec("router_logits")),
                       use_tqdm=False)[0]
    edits = [("post_attn", 0, clamp_edit(direction, -0.1, 0.1), None)]
    tokens, logprobs = HFSteered(hf, edits).greedy(prompt, 4)
    assert out.outputs[0].token_ids == tokens
    assert max_logprob_gap(out, logprobs) <= 1e-4
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, capture=CaptureSpec("router_logits")),
                         use_tqdm=False)[0]
    with torch.no_grad():
        ref = [r for r in hf(torch.tensor([prompt]), output_router_logits=True).router_logits if r is not None]
    for layer, expected in enumerate(ref):
        got = plain.captures["router_logits"][layer]
        assert (got - expected.reshape(len(prompt), -1)).abs().max().item() <= 1e-5


def test_gemma2_fused_tails_equal_torch(capture_dirs, monkeypatch):
    """Gemma 2's final logit soft-cap as one kernel and inside the fused sampler, and the post-norms
    inside the next fused add + norm kernels (the post-attention norm in the pre-feed-forward one,
    the post-feed-forward norm in the next layer's input norm and the final norm): greedy tokens and
    logprobs equal HF's (and differ from uncapped ones: the cap matters); seeded samples (decode
    steps that sample in the fused sampler) are the ones the three PyTorch ops and the separate
    norms give; a capture at ``mlp_out`` (which needs the post-feed-forward norm's output) is the
    same either way."""
    from steerable.models import gemma3

    calls = {"softcap_": 0, "gumbel_capped": 0}
    real_softcap, real_gumbel = logit_kernels.softcap_, logit_kernels.gumbel_argmax
    monkeypatch.setattr(logit_kernels, "softcap_", lambda *a: calls.__setitem__("softcap_", calls["softcap_"] + 1)
                        or real_softcap(*a))

    def gumbel(logits, temperature, seeds, softcap=None):
        calls["gumbel_capped"] += softcap is not None
        return real_gumbel(logits, temperature, seeds, softcap)

    monkeypatch.setattr(logit_kernels, "gumbel_argmax", gumbel)
    path = capture_dirs["gemma2"]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024, attention_backend="triton", max_num_seqs=4)
    hf = hf_model(path)
    prompts = [llm.get_tokenizer()(text).input_ids for text in ("Soft caps bend the logits", "A second prompt")]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    sampled = [SamplingParams(max_tokens=3, temperature=1.0, seed=11 + i, ignore_eos=True) for i in range(2)]
    tokens, logprobs = HFSteered(hf, []).greedy(prompts[0], 4)
    runs = {}
    real_add_norm = fused.add_rms_norm
    pre_normed = set()  # the post-norm weights the fused add + norm calls applied to their delta
    monkeypatch.setattr(fused, "add_rms_norm", lambda *a, **k: (k.get("delta_norm") is not None
                                                                and pre_normed.add(k["delta_norm"][0].data_ptr()))
                        or real_add_norm(*a, **k))
    mlp_out = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                             capture=CaptureSpec(layers=[0, 1], select="all", hook="mlp_out"))
    captured = {}
    for mode in ("torch", "kernel", "sampler"):
        monkeypatch.setattr(gemma3, "FINAL_SOFTCAP", mode)
        monkeypatch.setattr(gemma3, "FUSE_POST_NORM", mode == "sampler")
        out = llm.generate([prompts[0]], greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == tokens
        assert max_logprob_gap(out, logprobs) <= 1e-4
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)]
        captured[mode] = llm.generate([prompts[1]], mlp_out, use_tqdm=False)[0].captures["hidden_states"]
    assert runs["kernel"] == runs["torch"] == runs["sampler"]
    for layer in (0, 1):
        assert torch.equal(captured["sampler"][layer], captured["torch"][layer])
    layers = llm.llm_engine.worker.model.layers
    post_norms = {norm.weight.data_ptr() for layer in layers
                  for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm)}
    assert calls["softcap_"] > 0 and calls["gumbel_capped"] > 0 and pre_normed == post_norms  # the fused paths ran
    monkeypatch.setattr(llm.llm_engine.worker.model.cfg, "final_logit_softcapping", None)
    uncapped = llm.generate([prompts[0]], greedy, use_tqdm=False)[0]
    assert max_logprob_gap(uncapped, logprobs) > 1e-3  # the cap matters
