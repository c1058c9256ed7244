"""Invariant 1: float32 greedy output equals HF transformers with the same weights."""

import json
import shutil

import pytest
import torch
from conftest import FAMILIES, PROMPTS, hf_greedy, hf_model

from steerable import LLM, SamplingParams


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf_generate(model_dirs, family):
    path = model_dirs[family]
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # all eight prompts in one call
    assert len({len(o.prompt_token_ids) for o in outs}) >= 6, "prompts must have different lengths"
    hf = hf_model(path)
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 16), out.prompt


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_logits_match_hf(model_dirs, family):
    """Logits of every sampled position agree closely, not only the argmax."""
    path = model_dirs[family]
    llm = LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096)
    hf = hf_model(path)
    ids = llm.get_tokenizer()(PROMPTS[5]).input_ids
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    full = ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    for step, token in enumerate(out.outputs[0].token_ids):
        ours = out.outputs[0].logprobs[step]
        row = ref[len(ids) - 1 + step]
        for tok, lp in ours.items():
            assert abs(lp.logprob - row[tok].item()) < 1e-4
        assert ours[token].rank == 1


def test_sliding_window_is_applied(model_dirs, tmp_path):
    """Mistral's window (24) is shorter than the prompt + output here, so it must matter."""
    path = model_dirs["mistral"]
    unwindowed = tmp_path / "mistral_full"
    shutil.copytree(path, unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    config["sliding_window"] = None
    (unwindowed / "config.json").write_text(json.dumps(config))
    prompt = PROMPTS[5]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    windowed = LLM(path, dtype="float32", device="cpu", kv_cache_tokens=4096).generate(prompt, params, use_tqdm=False)
    full = LLM(str(unwindowed), dtype="float32", device="cpu", kv_cache_tokens=4096).generate(prompt, params,
                                                                                               use_tqdm=False)
    assert len(windowed[0].prompt_token_ids) > 24
    assert windowed[0].outputs[0].token_ids != full[0].outputs[0].token_ids
