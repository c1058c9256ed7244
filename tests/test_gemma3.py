"""Gemma 3 beyond the shared family tests (fidelity, steering, capture run it as the ``gemma3``
family): both config forms, windows and local RoPE that matter, the multimodal checkpoint's text
tower, post_attn captures, and batch invariance with sliding windows."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import PROMPTS, build_tokenizer, hf_greedy, hf_model
from hf_oracle import HFSteered

from steerable import LLM, CaptureSpec, SamplingParams
from steerable.hook_points import HookPoints
from steerable.layers.attention_backends import torch_ref
from steerable.models.gemma3 import Gemma3ForCausalLM, gemma3_config

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SLIDING, FULL = "sliding_attention", "full_attention"


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _rewrite_config(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    config = json.loads(open(f"{dst}/config.json").read())
    edit(config)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return dst


def _pattern_form(config: dict) -> None:
    """The layout of released Gemma 3 configs: no layer_types, a pattern, flat RoPE keys."""
    del config["layer_types"], config["rope_parameters"]
    config.update(sliding_window_pattern=2, sliding_window=6, rope_theta=1e5, rope_local_base_freq=500.0,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})


@pytest.fixture(scope="module")
def pattern_dir(model_dirs, tmp_path_factory) -> str:
    return _rewrite_config(model_dirs["gemma3"], str(tmp_path_factory.mktemp("gemma3") / "pattern"), _pattern_form)


@pytest.fixture(scope="module")
def gemma(model_dirs) -> LLM:
    return LLM(model_dirs["gemma3"], device="cpu", kv_cache_tokens=4096, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def alone(gemma) -> list[list[int]]:
    """Each prompt run alone, no prefix caching: the ground truth for batch invariance."""
    return [gemma.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in _prompts(gemma)]


def _prompts(llm) -> list[list[int]]:
    """Prompts longer than the window, four of them sharing a 32-token prefix (two blocks)."""
    tok = llm.get_tokenizer()
    shared = tok(PROMPTS[5] + " " + PROMPTS[3]).input_ids[:32]
    own = [tok(p).input_ids for p in PROMPTS]
    return [shared + ids[1:] for ids in own[:4]] + own[4:]


def test_config_forms():
    """transformers 5's per-layer-type rope_parameters and the flat 4.x keys with a pattern."""
    base = dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, num_hidden_layers=6, intermediate_size=128, vocab_size=100, rms_norm_eps=1e-6,
                max_position_embeddings=128, sliding_window=16, eos_token_id=1, tie_word_embeddings=True,
                query_pre_attn_scalar=64)
    nested = gemma3_config(SimpleNamespace(**base, layer_types=[SLIDING, FULL] * 3, rope_parameters={
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default",
                                                                                 "rope_theta": 1e4}}))
    flat = gemma3_config(SimpleNamespace(**base, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                                         rope_scaling={"type": "linear", "factor": 8.0}))
    for cfg in (nested, flat):
        assert cfg.layer_windows == [16, None] * 3
        assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
        assert (cfg.rope_scaling["rope_type"], cfg.rope_scaling["factor"]) == ("linear", 8.0)
        assert cfg.attention_scale == 64 ** -0.5 and cfg.qk_norm and cfg.tie_word_embeddings
    default = gemma3_config(SimpleNamespace(**base))  # no types, no pattern: every sixth layer is global
    assert default.layer_windows == [16] * 5 + [None]


@pytest.mark.parametrize("field, value", [("layer_types", [SLIDING] * 5), ("layer_types", ["local"] * 6),
                                          ("attn_logit_softcapping", 50.0), ("hidden_activation", "gelu"),
                                          ("sliding_window", None)])
def test_bad_config_names_the_field(field, value):
    hf = SimpleNamespace(architectures=["Gemma3ForCausalLM"], hidden_size=64, num_attention_heads=4,
                         num_hidden_layers=6, vocab_size=100, rms_norm_eps=1e-6, sliding_window=16)
    setattr(hf, field, value)
    with pytest.raises(ValueError, match=field):
        gemma3_config(hf)


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 25.25), (torch.float32, 25.298221588134766)])
def test_embedding_scale_is_rounded_to_the_weight_dtype(dtype, scale):
    """HF multiplies embeddings by sqrt(hidden) cast to the weight dtype: 25.25 in bfloat16 for 640."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    cfg = gemma3_config(SimpleNamespace(architectures=["Gemma3ForCausalLM"], hidden_size=640, num_attention_heads=4,
                                        head_dim=16, num_hidden_layers=1, intermediate_size=32, vocab_size=16,
                                        rms_norm_eps=1e-6, sliding_window=8, tie_word_embeddings=True))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Gemma3ForCausalLM(cfg, HookPoints(), torch_ref, 64)
    finally:
        torch.set_default_dtype(previous)
    assert model.embed_scale == scale
    hf = Gemma3TextScaledWordEmbedding(16, 640, 0, embed_scale=640 ** 0.5).to(dtype)
    hf.weight.data.copy_(torch.randn(16, 640, generator=torch.Generator().manual_seed(0)))
    model.embed_tokens.weight.data.copy_(hf.weight)
    ids = torch.arange(16)
    assert torch.equal(model.embed(ids), hf(ids))


def test_pattern_config_matches_hf(pattern_dir):
    llm = LLM(pattern_dir, device="cpu", kv_cache_tokens=4096)
    cfg = llm.engine.model_config
    assert cfg.layer_windows == [6, None, 6] and cfg.local_rope_theta == 500.0
    assert cfg.rope_scaling["factor"] == 4.0
    hf = hf_model(pattern_dir)
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [6, None, 6]
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16), out.prompt


@pytest.mark.parametrize("edit", ["no_window", "local_theta"])
def test_window_and_local_rope_matter(model_dirs, gemma, tmp_path, edit):
    """Effect-size checks: the same weights without the window, or with the global RoPE base on
    the local layers, generate differently, so the fidelity tests could catch either being lost."""
    def change(config: dict) -> None:
        if edit == "no_window":
            config["sliding_window"] = 4096
        else:
            config["rope_parameters"][SLIDING]["rope_theta"] = config["rope_parameters"][FULL]["rope_theta"]
    other = LLM(_rewrite_config(model_dirs["gemma3"], str(tmp_path / edit), change), device="cpu",
                kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [PROMPTS[3], PROMPTS[5], PROMPTS[7]]

    def chosen_logprobs(llm):
        return torch.tensor([next(iter(step.values())).logprob for out in llm.generate(prompts, params, use_tqdm=False)
                             for step in out.outputs[0].logprobs])
    assert (chosen_logprobs(other) - chosen_logprobs(gemma)).abs().max() > 1e-2


def test_final_logit_softcapping_matches_hf(model_dirs, tmp_path):
    """Released configs have none, but a config with a cap gets HF's tanh capping of the logits."""
    path = _rewrite_config(model_dirs["gemma3"], str(tmp_path / "capped"),
                           lambda config: config.update(final_logit_softcapping=2.0))
    llm, hf = LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.outputs[0].token_ids])).logits[0]
    assert logits.abs().max() <= 2.0  # capped
    ref = torch.log_softmax(logits.float(), -1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        for token, lp in entry.items():
            assert abs(lp.logprob - ref[len(ids) - 1 + step, token].item()) < 1e-4


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory) -> str:
    """A tiny Gemma3ForConditionalGeneration: the text tower plus a SigLIP vision tower and projector."""
    import transformers
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("gemma3_mm") / "model")
    build_tokenizer(path)
    vocab = len(AutoTokenizer.from_pretrained(path))
    text = dict(vocab_size=vocab + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8, initializer_range=0.15,
                max_position_embeddings=512, layer_types=[SLIDING, FULL], bos_token_id=1, eos_token_id=2,
                pad_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=vocab + 4, boi_token_index=vocab + 5,
                                       eoi_token_index=vocab + 6, eos_token_id=2)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def test_multimodal_checkpoint_loads_its_text_tower(multimodal_dir, caplog):
    from transformers import Gemma3ForConditionalGeneration

    with caplog.at_level(logging.INFO, logger="steerable.models.gemma3"):
        llm = LLM(multimodal_dir, device="cpu", kv_cache_tokens=4096)
    assert any("skipped" in r.getMessage() and "vision" in r.getMessage() for r in caplog.records)
    hf = Gemma3ForConditionalGeneration.from_pretrained(multimodal_dir, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16), out.prompt
    assert len({tuple(t) for t in _tokens(outs)}) > 1


def test_post_attn_and_heads_capture_equal_hf(capture_dirs):
    """post_attn here is the residual plus the post-attention-normed branch."""
    path = capture_dirs["gemma3"]
    llm, hf = LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)
    specs = [CaptureSpec(layers=[0, 1, 2], select="all", hook="post_attn"),
             CaptureSpec("attention_heads", layers=[0, 2], select="all")]
    for out in llm.generate(PROMPTS[3:6], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                         capture=specs), use_tqdm=False):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        hooked = {}
        HFSteered(hf, []).forward(torch.tensor([ids]), len(out.prompt_token_ids), capture=hooked)
        n = len(ids) - 1
        for layer in (0, 1, 2):
            ref = hooked[("post_attn", layer)][:n]
            assert (out.captures["hidden_states"][layer] - ref).abs().max() <= 1e-5
            assert (ref - hooked[("pre_attn", layer)][:n]).abs().max() > 0.1  # the branch added something
        for layer in (0, 2):
            assert (out.captures["attention_heads"][layer] - hooked[("attention_heads", layer)][:n]).abs().max() <= 1e-5


def test_batched_equals_alone(gemma, alone):
    assert _tokens(gemma.generate(_prompts(gemma), GREEDY, use_tqdm=False)) == alone


def test_chunked_prefill_and_prefix_cache(model_dirs, gemma, alone):
    llm = LLM(model_dirs["gemma3"], device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=24,
              enable_prefix_caching=True)
    prompts = _prompts(gemma)
    assert _tokens(llm.generate(prompts[:1], GREEDY, use_tqdm=False)) == alone[:1]
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == alone
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 3 * 32, stats
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_preemption(model_dirs, gemma, alone):
    llm = LLM(model_dirs["gemma3"], device="cpu", kv_cache_tokens=192, block_size=16, max_num_seqs=8)
    assert _tokens(llm.generate(_prompts(gemma), GREEDY, use_tqdm=False)) == alone
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_post_attention_norm_handed_to_the_next_norm_changes_nothing(gemma, monkeypatch):
    """``FUSE_POST_NORM``: the post-attention norm goes to ``residual_norm`` as the delta's norm (on a
    GPU, inside the fused add + norm kernel; here the PyTorch path applies it first): the same logprobs
    to the bit."""
    from steerable.hook_points import HookPoints
    from steerable.models import gemma3

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    prompts = _prompts(gemma)[:2]
    before = gemma.generate(prompts, params, use_tqdm=False)
    handed = []  # the delta norms residual_norm was given
    real = HookPoints.residual_norm
    monkeypatch.setattr(HookPoints, "residual_norm", lambda self, *a, delta_norm=None: handed.append(delta_norm)
                        or real(self, *a, delta_norm=delta_norm))
    monkeypatch.setattr(gemma3, "FUSE_POST_NORM", True)
    after = gemma.generate(prompts, params, use_tqdm=False)
    assert any(isinstance(norm, gemma3.GemmaRMSNorm) for norm in handed)
    for a, b in zip(before, after):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in a.outputs[0].logprobs] == \
            [{t: lp.logprob for t, lp in e.items()} for e in b.outputs[0].logprobs]
