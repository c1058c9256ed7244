"""Gemma 2, OLMo-2, Phi-3, GPT-2 and GPT-NeoX against HF on tiny random checkpoints: 32 greedy tokens
and logprobs for each family and the other value of its flags (soft-caps off and an untied head; a
tied OLMo-2; Phi-3 with plain RoPE, a tied head and a sliding window; an untied GPT-2; GPT-NeoX with
and without the parallel residual), captures at every hook point, additive steering and clamps under
chunked prefill, prefix caching and preemption, and effect-size checks: soft-caps, longrope's short
and long factors and OLMo-2's whole-projection q/k norm each change the output.

(The shared suites take these families too: test_fidelity, test_steering, test_capture,
test_fused_path, test_parallel.)
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from conftest import FAMILIES, PROMPTS, build_model, build_tokenizer, hf_model
from hf_oracle import HFSteered, add_edit, clamp_edit, max_logprob_gap

from steerable import LLM, Add, Clamp, SamplingParams, SelectSpec, SteeringSpec

NEW = ["gemma2", "olmo2", "phi3", "gpt2", "gpt_neox", "gpt_neox_seq"]  # gpt_neox_seq: use_parallel_residual=False
VARIANTS = {
    "gemma2_plain": ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                                    tie_word_embeddings=False)),
    "olmo2_tied": ("olmo2", dict(tie_word_embeddings=True)),
    "phi3_plain": ("phi3", dict(rope_scaling=None, tie_word_embeddings=True, sliding_window=24)),
    "gpt2_untied": ("gpt2", dict(tie_word_embeddings=False)),
}
TOKENS = 32
HOOKS = ["pre_attn", "post_attn", "post_mlp"]


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("rms_variants")
    build_tokenizer(str(root / "tokenizer"))
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(root / "tokenizer")))
    dirs = {}
    for i, (name, (family, changes)) in enumerate(VARIANTS.items()):
        spec = dict(FAMILIES[family])
        spec["extra"] = {**spec["extra"], **changes}
        dirs[name] = str(root / name)
        build_model(family, dirs[name], vocab, seed=40 + i, spec=spec)
    return dirs


def _rewrite(src: str, dst: str, change) -> str:
    shutil.copytree(src, dst)
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    change(config)
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)
    return dst


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)


def _check_against_hf(llm: LLM, path: str, prompts, tokens: int = TOKENS) -> None:
    """Greedy tokens of a batch of prompts equal HF ``generate``'s, logprobs within 1e-4 of HF's forward."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hf = hf_model(path)
    for out in outs:
        prompt = out.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), out.prompt
        rows = _hf_logprobs(hf, prompt + out.outputs[0].token_ids)[len(prompt) - 1:]
        gap = max(abs(lp.logprob - rows[step, token].item())
                  for step, entry in enumerate(out.outputs[0].logprobs) for token, lp in entry.items())
        assert gap <= 1e-4, (out.prompt, gap)


@pytest.mark.parametrize("name", NEW + list(VARIANTS))
def test_32_greedy_tokens_and_logprobs_match_hf(model_dirs, variant_dirs, name):
    path = {**model_dirs, **variant_dirs}[name]
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    assert len({len(llm.get_tokenizer()(p).input_ids) for p in prompts}) == 4
    _check_against_hf(llm, path, prompts)


def _chosen_logprobs(path: str, prompts, **kw) -> torch.Tensor:
    llm = LLM(path, device="cpu", kv_cache_tokens=4096, **kw)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    return torch.tensor([next(iter(step.values())).logprob for out in llm.generate(prompts, params, use_tqdm=False)
                         for step in out.outputs[0].logprobs])


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_softcap_matters(model_dirs, tmp_path, cap):
    """The same Gemma 2 weights without one of the caps score differently (a lost cap would show)."""
    path = model_dirs["gemma2"]
    uncapped = _rewrite(path, str(tmp_path / cap), lambda config: config.update({cap: None}))
    prompts = [PROMPTS[3], PROMPTS[5]]
    assert (_chosen_logprobs(uncapped, prompts) - _chosen_logprobs(path, prompts)).abs().max() > 1e-2


def test_olmo2_qk_norm_spans_all_heads():
    """The whole-projection norm is not a per-head one (the Qwen3 kind) on the same values."""
    from steerable.models import olmo2

    hidden = torch.randn(5, 64)
    norm = olmo2.ProjectionRMSNorm(64, 0, 64, 1, 1e-6)
    per_head = hidden.reshape(5, 4, 16)
    per_head = per_head * torch.rsqrt(per_head.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (norm(hidden) - per_head.reshape(5, 64)).abs().max() > 1e-2


def _long_config(original: int):
    def change(config: dict) -> None:
        config["original_max_position_embeddings"] = original
        config["rope_parameters"]["original_max_position_embeddings"] = original
    return change


def test_phi3_longrope_long_factors_match_hf_past_the_original_length(model_dirs, tmp_path):
    """With an original length of 32 and max_model_len 512 the engine uses the long factors (and the
    cos/sin scale): equal to HF's forward over a sequence longer than 32; with max_model_len 32 the
    short ones, equal to HF below it. The two sets give different outputs."""
    path = _rewrite(model_dirs["phi3"], str(tmp_path / "long"), _long_config(32))
    hf = hf_model(path)
    long_llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    ids = long_llm.get_tokenizer()(PROMPTS[5] + " " + PROMPTS[7]).input_ids
    assert len(ids) > 32
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    out = long_llm.generate([ids], params, use_tqdm=False)[0]
    rows = _hf_logprobs(hf, ids + out.outputs[0].token_ids)[len(ids) - 1:]
    assert out.outputs[0].token_ids == rows.argmax(-1)[:4].tolist()
    assert max_logprob_gap(out, rows) <= 1e-4
    short_llm = LLM(path, device="cpu", kv_cache_tokens=4096, max_model_len=32)
    short_prompt = ids[:20]
    short = short_llm.generate([short_prompt], params, use_tqdm=False)[0]
    rows = _hf_logprobs(hf, short_prompt + short.outputs[0].token_ids)[len(short_prompt) - 1:]
    assert max_logprob_gap(short, rows) <= 1e-4
    on_long = long_llm.generate([short_prompt], params, use_tqdm=False)[0]
    assert max_logprob_gap(on_long, rows) > 1e-2  # the long factors really are other frequencies


@pytest.fixture(scope="module", params=NEW)
def capture_pair(request, capture_dirs):
    path = capture_dirs[request.param]
    return LLM(path, device="cpu", kv_cache_tokens=8192, max_num_batched_tokens=16), hf_model(path)


def test_every_hook_point_capture_equals_hf_under_chunked_prefill(capture_pair):
    """pre_attn, post_attn, post_mlp and attention_heads of every layer (prompts chunked over a
    16-token budget) equal HF hooks at the same points."""
    from steerable import CaptureSpec

    llm, hf = capture_pair
    layers = list(range(llm.engine.model_config.num_layers))
    for hook in HOOKS:  # one hook point per request and stream
        specs = [CaptureSpec(hook=hook, layers=layers, select="all"),
                 CaptureSpec("attention_heads", layers=layers, select="all")]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=specs)
        for out in llm.generate([PROMPTS[1], PROMPTS[5]], params, use_tqdm=False):
            ids = out.prompt_token_ids + out.outputs[0].token_ids
            hooked = {}
            HFSteered(hf, []).forward(torch.tensor([ids]), len(out.prompt_token_ids), capture=hooked)
            n = len(ids) - 1
            for layer in layers:
                ours = out.captures["hidden_states"][layer]
                assert (ours - hooked[(hook, layer)][:n]).abs().max() <= 1e-5, (hook, layer)
                heads = out.captures["attention_heads"][layer]
                assert (heads - hooked[("attention_heads", layer)][:n]).abs().max() <= 1e-5


@pytest.fixture(scope="module", params=NEW)
def steer_pair(request, model_dirs):
    path = model_dirs[request.param]
    return path, hf_model(path)


def _vec(seed: int, scale: float = 3.0) -> list[float]:
    return (torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale).tolist()


@pytest.mark.parametrize("hook", HOOKS)
def test_add_and_clamp_equal_hf_under_chunked_prefill_and_prefix_cache(steer_pair, hook):
    """An add and a clamp at one hook point equal HF hooks doing the same, with prompts chunked over
    a 16-token budget, and again when the prompt's blocks come from the prefix cache."""
    path, hf = steer_pair
    llm = LLM(path, device="cpu", kv_cache_tokens=8192, max_num_batched_tokens=16)
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    add, direction = _vec(1), _vec(2)
    spec = SteeringSpec(vectors={hook: {1: add}}, clamps=[Clamp(2, direction, hook=hook, min=-0.3, max=0.3)])
    edits = [(hook, 1, add_edit(add), None), (hook, 2, clamp_edit(direction, -0.3, 0.3), None)]
    ref_tokens, ref_lp = HFSteered(hf, edits).greedy(ids, 8)
    plain_tokens, plain_lp = HFSteered(hf, []).greedy(ids, 8)
    assert plain_tokens != ref_tokens or (ref_lp - plain_lp).abs().max() > 0.05  # effect size
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, steering_vectors=spec)
    for _ in range(2):  # the second pass reads the first one's blocks from the prefix cache
        hits = llm.engine.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([ids], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref_tokens
        assert max_logprob_gap(out, ref_lp) <= 1e-4
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > hits


def test_preemption_keeps_steered_outputs(steer_pair):
    path, _ = steer_pair
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, steering_vectors=SteeringSpec(
        prefill_vectors={1: _vec(30 + i)}, decode_vectors={"post_attn": {2: _vec(60 + i)}},
        interventions=[Add(0, _vec(90 + i), select=SelectSpec(prompt_positions=[-1, -3]))]))
        if i % 2 else SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for i in range(8)]
    ref = LLM(path, device="cpu", kv_cache_tokens=8192, enable_prefix_caching=False)
    expected = [ref.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(path, device="cpu", kv_cache_tokens=256)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert llm.engine.stats()["num_preemptions"] > 0
