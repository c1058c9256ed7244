"""Load GGUF checkpoints (llama.cpp's format) as HF-shaped configs, tensors and tokenizers.

The engine's model code speaks HF parameter names and layouts, so a GGUF file is translated at the
boundary: metadata -> ``PretrainedConfig``, tensors -> dequantized ``(hf_name, tensor)`` pairs with the
llama.cpp q/k row permutation undone. The rest of the engine never needs to know the weights came from GGUF.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import transformers

from steerable.models.checkpoint import CheckpointTensor

# GGUF architecture -> (HF config class name, HF architecture, q/k rows permuted by llama.cpp's converter).
# Mistral GGUFs are llama-structured (llama.cpp converts them as such), so they load as Llama.
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", True),
    "mistral": ("LlamaConfig", "LlamaForCausalLM", True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
}

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no HF parameter (rope_freqs is folded into the config's rope parameters).
_NON_PARAMETERS = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@functools.lru_cache(maxsize=2)
def _reader(path: str):
    """GGUFReader memory-maps the file (tensors are paged in only when dequantized) but parses all
    metadata up front, seconds for a 49k-token vocabulary; config and weights share one parse."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _meta(reader, key: str, default: Any = None) -> Any:
    """Read a scalar/string metadata field without relying on newer gguf-py helpers (``contents()``)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key!r} is an array, expected a scalar")
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8") if field.types[0] == GGUFValueType.STRING else part.item()


def _arch(reader) -> str:
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    return arch


def _llama3_from_rope_freqs(freq_factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover llama3 rope scaling from the ``rope_freqs`` tensor llama.cpp writes instead of metadata.

    llama.cpp divides each rotary frequency by a factor: 1 (high freq), ``factor`` (low freq), and
    1/((1-s)/factor + s) in between, where s = (L/wavelen - lf)/(hf - lf). HF's llama3 formula is the same
    function of clamp(s, 0, 1), so only s's slope L/(hf-lf) and offset lf/(hf-lf) matter; fitting them on the
    smoothed band and fixing lf = 1 (as every Llama 3.x release does) reproduces the factors exactly.
    """
    ff = freq_factors.astype(np.float64)
    factor = float(ff.max())
    if factor <= 1.0 + 1e-6:
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (ff > 1.0 + 1e-4) & (ff < factor * (1 - 1e-4))
    if mid.sum() < 2:
        raise ValueError("cannot recover llama3 rope scaling from rope_freqs.weight: fewer than 2 smoothed bands")
    s = (1.0 / ff[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, offset = np.polyfit(inv_freq[mid] / (2 * math.pi), s, 1)  # s = slope/wavelen - offset
    offset = -offset
    return {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(1.0 + 1.0 / offset, 4),
        "original_max_position_embeddings": int(round(slope / offset)),
    }


def _rope_scaling(reader, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Translate ``{arch}.rope.scaling.*`` (or a llama3 ``rope_freqs`` tensor) into HF rope parameters."""
    p = f"{arch}.rope.scaling."
    kind = _meta(reader, p + "type")
    if kind == "none":
        return None
    if kind is None:
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is None:
            return None
        return _llama3_from_rope_freqs(np.asarray(freqs.data, dtype=np.float32).reshape(-1), theta, head_dim)
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(_meta(reader, p + "factor", 1.0))}
    orig = _meta(reader, p + "original_context_length")
    if kind == "linear":
        return scaling
    if kind == "yarn":
        optional = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
    elif kind == "llama3":
        optional = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor"}
    else:
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
    if orig is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    for gguf_key, hf_key in optional.items():
        if (value := _meta(reader, p + gguf_key)) is not None:
            scaling[hf_key] = float(value)
    return scaling


def load_gguf_config(path: str) -> transformers.PretrainedConfig:
    """Build the HF config a GGUF file implies, so the engine sizes its model from the file alone."""
    reader = _reader(path)
    arch = _arch(reader)
    cls_name, hf_arch, _ = _ARCHS[arch]
    config_cls = getattr(transformers, cls_name)

    def key(name: str, default: Any = None) -> Any:
        return _meta(reader, f"{arch}.{name}", default)

    names = {t.name: t for t in reader.tensors}
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if _ARCHS[arch][2] else None)
    head_dim = int(head_dim or hidden // n_heads)
    vocab = key("vocab_size")
    if vocab is None:  # embedding rows are what the weights need; the token list is a last resort
        embd = names.get("token_embd.weight")
        vocab = int(embd.shape[1]) if embd is not None else len(reader.fields["tokenizer.ggml.tokens"].data)
    theta = float(key("rope.freq_base", 10000.0))
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
    )
    if arch != "qwen2":  # Qwen2 always has q/k/v bias; the others only when the file carries one
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if (token_id := _meta(reader, f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            kwargs[hf_key] = int(token_id)
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    # transformers 5 keeps theta (and scaling) in rope_parameters; 4.x takes rope_theta + rope_scaling.
    if "rope_parameters" in inspect.signature(config_cls).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    return config_cls(**kwargs)


def _hf_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_LEVEL and suffix == "weight":
        return f"{_TOP_LEVEL[stem]}.weight"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unrecognised GGUF tensor {gguf_name!r}")


def _read(tensor, shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The ``box`` of a GGUF tensor in HF layout (GGUF lists dims fastest-first, so an HF row of a
    matrix is a GGUF row). A matrix's rows are cut from the memory map before dequantizing, and its
    columns too where they fall on quantization-block boundaries: only that part is paged in."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    data = np.asarray(tensor.data).reshape(shape[0] if len(shape) >= 2 else 1, -1)
    if len(shape) != 2:  # vectors (norms, biases) are small: decode whole, then cut
        return _decode(tensor, data).reshape(shape)[tuple(slice(a, b) for a, b in box)]
    (r0, r1), (c0, c1) = box
    rows = data[r0:r1]
    block, type_size = (1, 1) if tensor.tensor_type in (T.F32, T.F16) else GGML_QUANT_SIZES[tensor.tensor_type]
    if c0 % block == 0 and c1 % block == 0:
        return _decode(tensor, rows[:, c0 // block * type_size:c1 // block * type_size])
    return _decode(tensor, rows)[:, c0:c1]


def _decode(tensor, raw: np.ndarray) -> torch.Tensor:
    """Rows of stored data (typed for F32/F16, bytes otherwise) -> a float tensor of those rows."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    kind = tensor.tensor_type
    if kind in (T.F32, T.F16):  # the reader already typed these; copy out of the memory map
        return torch.from_numpy(np.array(raw))
    if kind == T.BF16:  # raw bytes; reinterpret directly so a bf16 target skips the fp32 round trip
        return torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(dequantize(np.array(raw), kind)).reshape(len(raw), -1)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {kind.name} for {tensor.name!r}") from None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotate-half -> interleaved pairs) to get HF's layout back.

    The converter stored ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _slice(tensor, dtype: torch.dtype, permuted_heads: int | None) -> CheckpointTensor:
    shape = tuple(reversed([int(d) for d in tensor.shape]))

    def read(box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        w = _read(tensor, shape, box)
        if permuted_heads:  # the permutation stays inside each head's rows: a slice of whole heads undoes alone
            head_rows = shape[0] // permuted_heads
            start, stop = box[0]
            if start % head_rows or stop % head_rows:
                raise ValueError(f"{tensor.name}: rows [{start}, {stop}) do not cover whole heads of {head_rows} rows")
            w = _unpermute(w, (stop - start) // head_rows)
        return w.to(dtype)

    return CheckpointTensor(shape, read)


def iter_gguf_slices(path: str, dtype: torch.dtype, num_heads: int = 0,
                     num_kv_heads: int = 0) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(hf_name, tensor)`` pairs, each tensor read (dequantized, q/k un-permuted with the
    head counts) only when loaded and only in the part loaded: a rank's shard, or all of it.

    ``lm_head.weight`` is only yielded when the file has its own ``output.weight`` (i.e. not tied).
    """
    reader = _reader(path)
    permuted = _ARCHS[_arch(reader)][2]
    for tensor in reader.tensors:
        if tensor.name in _NON_PARAMETERS:
            continue
        name = _hf_name(tensor.name)
        heads = None
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
        yield name, _slice(tensor, dtype, heads)


def iter_gguf_tensors(path: str, config: transformers.PretrainedConfig | None,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor read whole, one at a time (peak memory is one dequantized tensor)."""
    heads = (config.num_attention_heads, config.num_key_value_heads) if config is not None else (0, 0)
    for name, tensor in iter_gguf_slices(path, dtype, *heads):
        yield name, tensor.load()


def load_gguf_tokenizer(path: str):
    """Let transformers rebuild the tokenizer from the GGUF's embedded vocab, merges and chat template."""
    from transformers import AutoTokenizer

    path = os.path.abspath(path)
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
