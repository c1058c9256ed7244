"""GGUF files of Gemma 2, Phi-3 and GPT-2 written with the ``gguf`` package from tiny HF checkpoints,
under llama.cpp's tensor names and metadata (Gemma norms stored plus one, Phi-3's fused ``attn_qkv``
and ``ffn_up``, longrope factors as tensors; GPT-2's Conv1D weights transposed, its byte-level BPE
vocabulary and merges in the file): the config, every tensor and the engine's greedy tokens and
logprobs equal HF's on the checkpoint the file came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAMILIES, PROMPTS, build_model, hf_greedy, hf_model
from hf_oracle import max_logprob_gap
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from steerable import LLM, SamplingParams  # noqa: E402
from steerable.engine import engine as engine_module  # noqa: E402
from steerable.models.gguf import iter_gguf_slices, iter_gguf_tensors, load_gguf_config  # noqa: E402
from steerable.models.registry import resolve_model_config  # noqa: E402

_GEMMA2_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
_PHI3_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_COMMON_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def _gguf_name(hf_name: str, arch: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    table = {**_COMMON_LAYER, **(_GEMMA2_LAYER if arch == "gemma2" else _PHI3_LAYER)}
    return f"blk.{layer}.{table[module]}.{kind}"


def write_gguf(src: str, path: Path, arch: str) -> None:
    """The GGUF llama.cpp's converter writes for the HF checkpoint ``src`` (tensors in float32)."""
    config = json.loads(Path(src, "config.json").read_text())
    tensors = load_file(str(Path(src, "model.safetensors")))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if arch == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    else:
        writer.add_sliding_window(config.get("sliding_window") or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_attn_factors(rope["attention_factor"])
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    for name, tensor in tensors.items():
        value = tensor.float()
        if arch == "gemma2" and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp stores Gemma's norms as 1 + w
        writer.add_tensor(_gguf_name(name, arch), value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_gpt2_vocab(writer, src: str, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's ``_set_vocab_gpt2`` writes it: every token in id order, special
    added tokens marked CONTROL, merges and special ids through gguf-py's ``SpecialVocab``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    by_id = {i: token for token, i in tok.get_vocab().items()}
    added = tok.added_tokens_decoder
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([by_id[i] for i in range(vocab_size)])
    writer.add_token_types([control if i in added and added[i].special else normal for i in range(vocab_size)])
    gguf.SpecialVocab(src, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer)


def write_gpt2_gguf(src: str, path: Path) -> None:
    """What llama.cpp's ``GPT2Model`` converter writes: its five hyperparameters (the feed-forward
    length as 4 * n_embd, whatever ``n_inner`` says), gguf-py's tensor names with the Conv1D weights
    transposed to ``[out, in]``, the causal-mask buffers dropped, and the vocabulary."""
    config = json.loads(Path(src, "config.json").read_text())
    tensors = load_file(str(Path(src, "model.safetensors")))
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(config["n_layer"])
    writer.add_context_length(config.get("n_ctx", config["n_positions"]))
    writer.add_embedding_length(config["n_embd"])
    writer.add_feed_forward_length(4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_gpt2_vocab(writer, src, config["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT2, config["n_layer"])
    for name, tensor in tensors.items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        value = tensor.float()
        if name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            value = value.t().contiguous()
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sources(model_dirs, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Per family (the HF directory, the GGUF written from it). llama.cpp derives Gemma 2's query
    scale from head_dim (hidden / heads for the 27B), so that checkpoint gets that scale. GPT-2
    comes tied (no ``output`` tensor) and untied (``output.weight``, which must not be taken for a
    transposed ``attn_output``)."""
    root = tmp_path_factory.mktemp("gguf_families")
    gemma2 = root / "gemma2"
    shutil.copytree(model_dirs["gemma2"], gemma2)
    config = json.loads((gemma2 / "config.json").read_text())
    config["query_pre_attn_scalar"] = config["head_dim"]
    (gemma2 / "config.json").write_text(json.dumps(config))
    out = {}
    for arch, src in (("gemma2", str(gemma2)), ("phi3", model_dirs["phi3"])):
        write_gguf(src, root / f"{arch}.gguf", arch)
        out[arch] = (src, str(root / f"{arch}.gguf"))
    untied = dict(FAMILIES["gpt2"], extra={**FAMILIES["gpt2"]["extra"], "tie_word_embeddings": False})
    vocab = json.loads(Path(model_dirs["gpt2"], "config.json").read_text())["vocab_size"]
    build_model("gpt2", str(root / "gpt2_untied"), vocab, seed=3, spec=untied)  # output.weight in the file
    for name, src in (("gpt2", model_dirs["gpt2"]), ("gpt2_untied", str(root / "gpt2_untied"))):
        write_gpt2_gguf(src, root / f"{name}.gguf")
        out[name] = (src, str(root / f"{name}.gguf"))
    return out


def _close(a, b) -> bool:
    """Equal, floats to float32 precision (GGUF metadata keeps float32)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6)
    return a == b


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "gpt2", "gpt2_untied"])
def test_config_and_tensors_equal_the_checkpoint(sources, arch):
    src, path = sources[arch]
    from transformers import AutoConfig

    ours = resolve_model_config(load_gguf_config(path))[1]
    theirs = resolve_model_config(AutoConfig.from_pretrained(src))[1]
    for field in ("architecture", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                  "tie_word_embeddings", "sliding_window", "attn_logit_softcapping", "attention_scale"):
        assert _close(getattr(ours, field), getattr(theirs, field)), field
    if arch.startswith("gpt2"):  # the MLP width is n_inner's (the tensors'), not the metadata's 4 * n_embd
        assert ours.intermediate_size == theirs.intermediate_size == 128
        assert ours.hidden_act == theirs.hidden_act == "gelu_new"
        assert ours.max_position_embeddings == theirs.max_position_embeddings == 512
    elif arch == "gemma2":
        assert ours.layer_windows == theirs.layer_windows == [8, None, 8, None]
        assert ours.final_logit_softcapping == theirs.final_logit_softcapping == 4.0
    else:
        assert ours.rope_scaling["rope_type"] == "longrope"
        assert ours.rope_scaling["attention_factor"] == pytest.approx(1.1)
    expected = load_file(str(Path(src, "model.safetensors")))
    loaded = dict(iter_gguf_tensors(path, None, torch.float32))
    assert set(loaded) == set(expected) - ({"lm_head.weight"} if theirs.tie_word_embeddings else set())
    for name, tensor in loaded.items():  # Gemma's norms went through + 1 - 1 in float32
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    if arch.startswith("gpt2"):  # a rank's part of a Conv1D weight turned back to [in, out]: the same part of HF's
        for name, tensor in iter_gguf_slices(path, torch.float32):
            if name.endswith("c_attn.weight"):
                part = tensor.narrow(1, 64, 64).narrow(0, 16, 32).load()
                assert torch.equal(part, expected[name][16:48, 64:128]), name


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_engine_on_the_gguf_equals_hf(sources, arch, monkeypatch):
    """Greedy tokens and logprobs of the engine on the file equal HF's on the checkpoint (token-id
    prompts: the tiny files carry no tokenizer, which is not what is under test here)."""
    src, path = sources[arch]
    monkeypatch.setattr(engine_module, "load_tokenizer", lambda source: None)
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    hf = hf_model(src)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    for prompt in (PROMPTS[1], PROMPTS[5]):
        ids = tok(prompt).input_ids
        out = llm.generate([ids], params, use_tqdm=False)[0]
        with torch.no_grad():
            full = torch.tensor([ids + out.outputs[0].token_ids])
            rows = torch.log_softmax(hf(full, use_cache=False).logits[0].float(), -1)[len(ids) - 1:]
        assert out.outputs[0].token_ids == rows.argmax(-1)[:12].tolist()
        assert max_logprob_gap(out, rows) <= 1e-4


def test_gpt2_gguf_tokenizer_and_32_greedy_tokens_equal_hf(sources):
    """The file's own byte-level BPE encodes text as the checkpoint's tokenizer does (special tokens
    whole), and the engine's 32 greedy tokens over a batch of prompts of different lengths equal HF
    ``generate``'s on the checkpoint, logprobs within 1e-4 of HF's forward."""
    from transformers import AutoTokenizer

    src, path = sources["gpt2"]
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    ours, theirs = llm.get_tokenizer(), AutoTokenizer.from_pretrained(src)
    texts = PROMPTS + ["<|user|>Hi</s>  two  spaces, caf\u00e9 \U0001F600"]
    assert [ours(t).input_ids for t in texts] == [theirs(t).input_ids for t in texts]
    assert ours.eos_token_id == theirs.eos_token_id == 2
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    assert len({len(theirs(p).input_ids) for p in prompts}) == 4
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    hf = hf_model(src)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out.prompt_token_ids == theirs(out.prompt).input_ids
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 32), out.prompt
        with torch.no_grad():
            full = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
            rows = torch.log_softmax(hf(full, use_cache=False).logits[0].float(), -1)[len(out.prompt_token_ids) - 1:]
        assert max_logprob_gap(out, rows) <= 1e-4
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1  # the prompts steer different continuations
