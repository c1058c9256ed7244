"""Attention-pattern capture: each head's softmax for the selected query rows equals HF
``output_attentions`` (eager) on Llama, Qwen3 (q/k norm), Gemma 3 (sliding and global layers) and
Mistral (sliding window), for prompt and generated rows, under chunked prefill, prefix caching
and preemption, with steering at ``pre_attn``; labels, heads, budgets, bad input."""

import random

import pytest
import torch
from conftest import PROMPTS, hf_model
from hf_oracle import HFSteered, add_edit, decoder_layers

import steerable
from steerable import LLM, CaptureSpec, SamplingParams, SelectSpec
from steerable.capture import ATTENTION_PATTERNS, AttentionPatterns

TOL = 1e-5


def hf_patterns(hf, ids: list[int], prompt_len: int, edits=()) -> list[torch.Tensor]:
    """Per layer, HF's eager attention probabilities ``[heads, q, k]`` over ``ids`` (with ``edits``)."""
    layers = decoder_layers(hf)
    got = {}
    attention = [getattr(layer, name) for layer in layers for name in ("self_attn", "attn", "attention")
                 if hasattr(layer, name)]  # Llama-likes, GPT-2, GPT-NeoX
    handles = [attn.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[1][0].clone()))
               for i, attn in enumerate(attention)]
    try:
        HFSteered(hf, list(edits)).forward(torch.tensor([ids]), prompt_len)
    finally:
        for h in handles:
            h.remove()
    return [got[i] for i in range(len(layers))]


def assert_equal_hf(out, ref: list[torch.Tensor], layers, heads=None, window_of=lambda layer: None) -> None:
    """Every captured row equals HF's for its position; labels and key ranges exact; sums are 1."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    for layer in layers:
        pat = out.captures[ATTENTION_PATTERNS][layer]
        meta = out.capture_meta[ATTENTION_PATTERNS][layer]
        assert isinstance(pat, AttentionPatterns) and len(pat) == len(meta) > 0
        assert meta.token_ids.tolist() == [ids[p] for p in meta.positions.tolist()]
        wanted = list(range(ref[layer].shape[0])) if heads is None else heads
        assert pat.heads == wanted
        window = window_of(layer)
        for i, p in enumerate(meta.positions.tolist()):
            start = 0 if window is None else max(0, p - window + 1)
            assert (int(pat.key_starts[i]), int(pat.key_lens[i])) == (start, p + 1 - start)
            row = pat.rows[i]
            assert row.dtype == torch.float32 and row.shape == (len(wanted), p + 1 - start)
            assert (row - ref[layer][wanted, p, start:p + 1]).abs().max() <= TOL
            assert (row.sum(-1) - 1).abs().max() <= TOL
        dense = pat.padded()
        assert dense.shape == (len(pat), len(wanted), int(pat.key_lens.max()))
        for i, row in enumerate(pat.rows):
            assert torch.equal(dense[i, :, :row.shape[1]], row) and not dense[i, :, row.shape[1]:].any()


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "mistral"])
def family(request, capture_dirs):
    path = capture_dirs[request.param]
    # A 16-token budget: the longer prompts are prefilled in chunks.
    return LLM(path, device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=16), hf_model(path)


def test_patterns_equal_hf(family):
    llm, hf = family
    cfg = llm.engine.model_config
    layers = list(range(cfg.num_layers))
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[5]]  # 32, 1 and 32+ tokens (past Mistral's 24 and Gemma's 8)
    specs = [CaptureSpec(stream=ATTENTION_PATTERNS, layers=layers, select="all"),
             CaptureSpec(stream=ATTENTION_PATTERNS, layers=[0, 2], heads=[3, 1],
                         select=SelectSpec(prompt_positions=[0, -1], generation="all")),
             CaptureSpec(stream=ATTENTION_PATTERNS, layers=[2], select="last_prompt", dtype="float32")]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, capture=s) for s in specs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for k, out in enumerate(outs):
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        ref = hf_patterns(hf, ids[:-1], len(out.prompt_token_ids))
        heads = [1, 3] if k == 1 else None
        assert_equal_hf(out, ref, sorted(out.captures[ATTENTION_PATTERNS]), heads, cfg.attention_window)
        positions = out.capture_meta[ATTENTION_PATTERNS][2].positions.tolist()
        n = len(out.prompt_token_ids)
        assert positions == [list(range(len(ids) - 1)), sorted({0, n - 1}) + [n, n + 1, n + 2], [n - 1]][k]
    uniform = outs[0].captures[ATTENTION_PATTERNS][0].rows[-1]
    assert (uniform - 1 / uniform.shape[1]).abs().max() > 1e-3  # not a no-op: the heads attend unevenly


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "olmo2"])
def test_other_families_equal_hf(capture_dirs, name):
    """GPT-2 (no RoPE, its own attention module), GPT-NeoX (partial rotary) and OLMo-2 (q/k norm
    over the whole projection) place the pattern hook too: prompt and generated rows equal HF."""
    llm, hf = LLM(capture_dirs[name], device="cpu", kv_cache_tokens=2048), hf_model(capture_dirs[name])
    spec = CaptureSpec(stream=ATTENTION_PATTERNS, layers=[0, 2], heads=[2, 0],
                       select=SelectSpec(prompt_positions=[1, -1], generation="all"))
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=spec),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    assert_equal_hf(out, hf_patterns(hf, ids[:-1], len(out.prompt_token_ids)), [0, 2], heads=[0, 2])
    assert len(out.capture_meta[ATTENTION_PATTERNS][0]) == 4
    last = out.captures[ATTENTION_PATTERNS][2].rows[-1]
    assert (last - 1 / last.shape[1]).abs().max() > 1e-3  # not a no-op: the heads attend unevenly


def test_steering_at_pre_attn_equals_hf_with_the_same_hook(capture_dirs):
    path = capture_dirs["llama"]
    llm, hf = LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)
    v = (torch.randn(64, generator=torch.Generator().manual_seed(3)) * 4).tolist()
    prompt = llm.get_tokenizer()(PROMPTS[3]).input_ids
    spec = CaptureSpec(stream=ATTENTION_PATTERNS, layers=[1, 2], select="all")
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, capture=spec,
                                                steering_vectors={"pre_attn": {1: v}}), use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    steered = hf_patterns(hf, ids[:-1], len(prompt), [("pre_attn", 1, add_edit(v), None)])
    assert_equal_hf(out, steered, [1, 2])
    plain = hf_patterns(hf, ids[:-1], len(prompt))
    last = out.captures[ATTENTION_PATTERNS][1].rows[-1]
    # The steering changed the pattern: by a quarter of its largest weight (small random weights
    # attend almost uniformly).
    assert (last - plain[1][:, len(ids) - 2]).abs().max() > 0.25 * last.max()


def test_prefix_cache_and_cached_prompt_rows(capture_dirs):
    path = capture_dirs["llama"]
    llm, hf = LLM(path, device="cpu", kv_cache_tokens=4096), hf_model(path)
    prompt = list(range(30, 100))  # 70 tokens: 4 full blocks of 16

    def hits() -> int:
        return llm.llm_engine.stats()["prefix_cache_hit_tokens"]

    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    base = llm.generate([prompt], plain, use_tqdm=False)[0]
    ref = hf_patterns(hf, prompt + base.outputs[0].token_ids[:1], len(prompt))
    before = hits()
    # The last prompt row reads the cached prefix's K: 64 tokens come from the cache.
    last = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, capture=CaptureSpec(
        stream=ATTENTION_PATTERNS, layers=[0, 2], select="last_prompt")), use_tqdm=False)[0]
    assert hits() == before + 64
    assert_equal_hf(last, ref, [0, 2])
    # Rows inside the cached prefix: their queries must be computed, so the hit stops at the first one.
    inside = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, capture=CaptureSpec(
        stream=ATTENTION_PATTERNS, layers=[1], select=SelectSpec(prompt_positions=[5, 40]))), use_tqdm=False)[0]
    assert hits() == before + 64
    assert inside.capture_meta[ATTENTION_PATTERNS][1].positions.tolist() == [5, 40]
    assert_equal_hf(inside, ref, [1])
    late = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, capture=CaptureSpec(
        stream=ATTENTION_PATTERNS, layers=[1], select=SelectSpec(prompt_positions=[40]))), use_tqdm=False)[0]
    assert hits() == before + 64 + 32  # blocks 0 and 1 lie wholly before row 40
    assert late.capture_meta[ATTENTION_PATTERNS][1].positions.tolist() == [40]
    assert_equal_hf(late, ref, [1])


def test_preemption_records_each_row_once(capture_dirs):
    path = capture_dirs["qwen3"]
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randrange(20, 50))] for _ in range(10)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                            capture=CaptureSpec(stream=ATTENTION_PATTERNS, layers=[0, 2], select="all"))
    expected = LLM(path, device="cpu", kv_cache_tokens=4096).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    for out, exp in zip(outs, expected):
        assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        n = len(out.prompt_token_ids) + 10 - 1
        for layer in (0, 2):
            assert out.capture_meta[ATTENTION_PATTERNS][layer].positions.tolist() == list(range(n))
            ours, theirs = out.captures[ATTENTION_PATTERNS][layer], exp.captures[ATTENTION_PATTERNS][layer]
            assert all((a - b).abs().max() <= TOL for a, b in zip(ours.rows, theirs.rows))


def test_capture_helper_budget_and_model_dtype(capture_dirs):
    llm = LLM(capture_dirs["gemma3"], device="cpu", kv_cache_tokens=4096)
    result = steerable.capture(llm, PROMPTS[:3], stream=ATTENTION_PATTERNS, layers=[0, 2], select="last_prompt")
    rows = result.rows(0)
    assert isinstance(rows, AttentionPatterns) and len(rows) == 3 == len(result.meta(0))
    assert rows.key_lens.tolist() == [min(8, n) for n in rows.key_lens.tolist()]  # layer 0 slides over 8 keys
    assert result.rows(2).key_lens.tolist() == [p + 1 for p in result.meta(2).positions.tolist()]
    capped = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4, capture=CaptureSpec(
        stream=ATTENTION_PATTERNS, layers=[1], select="all", budget_rows=3, dtype="bfloat16")), use_tqdm=False)[0]
    pat = capped.captures[ATTENTION_PATTERNS][1]
    assert len(pat) == 3 and pat.dtype == torch.bfloat16
    assert capped.capture_meta[ATTENTION_PATTERNS][1].positions.tolist() == [0, 1, 2]


@pytest.mark.parametrize("spec, field", [
    (CaptureSpec(stream=ATTENTION_PATTERNS, heads=[4]), "capture.heads"),
    (CaptureSpec(stream=ATTENTION_PATTERNS, heads=[]), "capture.heads"),
    (CaptureSpec(heads=[0]), "capture.heads"),
    (CaptureSpec(stream=ATTENTION_PATTERNS, reduce="mean"), "capture.reduce"),
    (CaptureSpec(stream=ATTENTION_PATTERNS, layers=[3]), "capture.layers"),
])
def test_bad_pattern_input(capture_dirs, spec, field):
    llm = LLM(capture_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    with pytest.raises(ValueError, match=field):
        llm.generate(["hello"], SamplingParams(capture=spec), use_tqdm=False)
    with pytest.raises(ValueError, match="stream"):
        llm.start_capture(ATTENTION_PATTERNS)
    assert llm.llm_engine.stats()["num_requests"] == 0
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_wire_round_trip_is_bit_exact(capture_dirs):
    from steerable.capture import deserialize_captured
    from steerable.capture.serialization import serialize_captured

    llm = LLM(capture_dirs["mistral"], device="cpu", kv_cache_tokens=2048)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0, capture=CaptureSpec(
        stream=ATTENTION_PATTERNS, layers=[0, 2], heads=[2], select="all")), use_tqdm=False)[0]
    for text in (False, True):
        wire = serialize_captured(out.captures[ATTENTION_PATTERNS], out.capture_meta[ATTENTION_PATTERNS], text=text)
        tensors, metas = deserialize_captured(wire)
        for layer, pat in out.captures[ATTENTION_PATTERNS].items():
            back = tensors[layer]
            assert metas[layer] == out.capture_meta[ATTENTION_PATTERNS][layer] and back.heads == [2]
            assert torch.equal(back.key_starts, pat.key_starts) and torch.equal(back.key_lens, pat.key_lens)
            assert all(torch.equal(a, b) for a, b in zip(back.rows, pat.rows))
