"""Qwen3-MoE: greedy fidelity to HF transformers, router-logit hook point, dense-layer placement,
norm_topk_prob both ways, and the expert weight loader (per-expert and fused 3-D names)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PROMPTS, build_tokenizer, hf_greedy, hf_model
from safetensors.torch import load_file

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.hook_points import ROUTER_LOGITS, HookPoints
from steerable.layers.attention_backends import torch_ref
from steerable.models.registry import model_class

CONFIGS = {
    # layer 1 dense through mlp_only_layers; renormalised top-k weights
    "mlp_only": dict(num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True),
    # every second layer sparse (1, 3); raw softmax top-k weights
    "sparse_step": dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False),
}
EXPECTED_SPARSE = {"mlp_only": [0, 2], "sparse_step": [1, 3]}


def build_qwen3_moe(path: str, seed: int, **overrides) -> None:
    import transformers
    from transformers import AutoTokenizer

    build_tokenizer(path)
    vocab = len(AutoTokenizer.from_pretrained(path))
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        initializer_range=0.15, tie_word_embeddings=False, **overrides)
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        config.rope_theta = 10000.0
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen3_moe")
    dirs = {}
    for seed, (name, overrides) in enumerate(CONFIGS.items()):
        dirs[name] = str(root / name)
        build_qwen3_moe(dirs[name], seed=100 + seed, **overrides)
    return dirs


@pytest.fixture(scope="module")
def llms(moe_dirs) -> dict[str, LLM]:
    return {name: LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096) for name, path in moe_dirs.items()}


@pytest.fixture(scope="module")
def hfs(moe_dirs):
    return {name: hf_model(path) for name, path in moe_dirs.items()}


def _sparse_layers(llm: LLM) -> list[int]:
    return llm.capture_status(ROUTER_LOGITS)["hooked_layers"]


def _router_logits(llm: LLM, prompts, max_tokens: int):
    """Every row's router logits at every sparse layer, through the public capture plane."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, skip_reading_prefix_cache=True,
                            capture=CaptureSpec(ROUTER_LOGITS))
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sparse_layer_placement_matches_hf(llms, hfs, name):
    hf_sparse = [i for i, layer in enumerate(hfs[name].model.layers) if hasattr(layer.mlp, "gate")]
    assert _sparse_layers(llms[name]) == hf_sparse == EXPECTED_SPARSE[name]
    assert llms[name].llm_engine.model_config.norm_topk_prob == CONFIGS[name]["norm_topk_prob"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf_generate(llms, hfs, name):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llms[name].generate(PROMPTS, params, use_tqdm=False)  # all eight prompts in one call
    assert len({len(o.prompt_token_ids) for o in outs}) >= 6
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hfs[name], out.prompt_token_ids, 16), out.prompt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_router_logits_match_hf(llms, hfs, name):
    llm = llms[name]
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    seen = _router_logits(llm, [ids], 1)[0].captures[ROUTER_LOGITS]
    with torch.no_grad():
        ref = hfs[name](torch.tensor([ids]), output_router_logits=True).router_logits
    ref = [r for r in ref if r is not None]  # one [T, E] tensor per sparse layer (4.x may pad with None)
    sparse = _sparse_layers(llm)
    assert sorted(seen) == sparse and len(ref) == len(sparse)
    for layer, expected in zip(sparse, ref):
        ours = seen[layer]
        expected = expected.reshape(-1, expected.shape[-1])
        assert ours.shape == expected.shape == (len(ids), 8)
        assert expected.std() > 0.1  # the router is not trivially zero
        assert (ours - expected).abs().max().item() <= 1e-5, layer


def test_dense_layer_emits_no_router_logits(llms):
    for name, llm in llms.items():
        outs = _router_logits(llm, PROMPTS[:2], 3)
        dense = set(range(llm.llm_engine.model_config.num_layers)) - set(EXPECTED_SPARSE[name])
        for out in outs:
            seen = out.captures[ROUTER_LOGITS]
            assert dense and not dense & set(seen)
            assert sorted(seen) == EXPECTED_SPARSE[name]
            rows = len(out.prompt_token_ids) + 2  # the prompt and two generated inputs
            assert all(t.shape == (rows, 8) for t in seen.values())


def _fresh_model(llm: LLM):
    cfg = llm.llm_engine.model_config
    return model_class(cfg.architecture)(cfg, HookPoints(), torch_ref, 512)


def test_loads_fused_3d_expert_names(moe_dirs, llms):
    """transformers 5.x in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    state = load_file(os.path.join(moe_dirs["mlp_only"], "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        parts = key.split(".")
        if "experts" in parts:
            i = parts.index("experts")
            per_expert.setdefault(".".join(parts[:i + 1]), {}).setdefault(int(parts[i + 1]), {})[parts[i + 2]] = tensor
        else:
            fused[key] = tensor
    assert per_expert, "expected save_pretrained to write per-expert tensors"
    for prefix, experts in per_expert.items():
        n = len(experts)
        fused[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(n)])
        fused[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)])
    model = _fresh_model(llms["mlp_only"])
    model.load_weights(fused.items())
    per_expert_model = _fresh_model(llms["mlp_only"])
    per_expert_model.load_weights(state.items())
    reference = dict(per_expert_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name


def test_missing_expert_weight_is_reported(moe_dirs, llms):
    state = load_file(os.path.join(moe_dirs["mlp_only"], "model.safetensors"))
    del state["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing weights.*layers\.2\.mlp\.experts_gate_up"):
        _fresh_model(llms["mlp_only"]).load_weights(state.items())
    state = load_file(os.path.join(moe_dirs["mlp_only"], "model.safetensors"))
    state["model.layers.0.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 31)
    with pytest.raises(ValueError, match="checkpoint shape"):
        _fresh_model(llms["mlp_only"]).load_weights(state.items())


def test_chunked_prefill_matches_batched(moe_dirs, llms):
    """Routing is per token, so splitting prompts into 16-token chunks changes nothing."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    chunked = LLM(moe_dirs["sparse_step"], dtype="float32", device="cpu", kv_cache_tokens=4096,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
    ref = llms["sparse_step"].generate(PROMPTS, params, use_tqdm=False)
    outs = chunked.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_router_logits_capture_stream(llms, hfs):
    """The public capture plane records the router_logits stream of exactly the sparse layers."""
    capture = pytest.importorskip("steerable.capture")
    if not hasattr(capture, "CaptureSpec"):
        pytest.skip("capture plane not available")
    llm = llms["mlp_only"]
    assert llm.llm_engine.model_config.router_layers == EXPECTED_SPARSE["mlp_only"]
    ids = llm.get_tokenizer()(PROMPTS[3]).input_ids
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, skip_reading_prefix_cache=True,
                                             capture=capture.CaptureSpec("router_logits")), use_tqdm=False)[0]
    got = out.captures["router_logits"]
    assert sorted(got) == EXPECTED_SPARSE["mlp_only"]
    with torch.no_grad():
        ref = [r for r in hfs["mlp_only"](torch.tensor([ids]), output_router_logits=True).router_logits if r is not None]
    for layer, expected in zip(sorted(got), ref):
        assert got[layer].shape == (len(ids), 8)
        assert (got[layer].float() - expected.reshape(len(ids), 8)).abs().max().item() <= 1e-5
