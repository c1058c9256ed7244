"""Load GGUF checkpoints (llama.cpp's format) as HF-shaped configs, tensors and tokenizers.

The engine's model code speaks HF parameter names and layouts, so a GGUF file is translated at the
boundary: metadata -> ``PretrainedConfig``, tensors -> dequantized ``(hf_name, tensor)`` pairs with the
llama.cpp q/k row permutation undone. The rest of the engine never needs to know the weights came from GGUF.

Gemma 3 (``gemma3``): llama.cpp's converter stores every norm weight plus one, and leaves out the
window pattern, the local RoPE base and ``query_pre_attn_scalar`` (llama.cpp hard-codes them). As
transformers does, the norms get their one back off (in float32, so the model's ``1 + w`` equals the
file's value as HF computes it) and the missing values come from the family's known ones.

Gemma 2 (``gemma2``) is stored the same way (norms plus one, sandwich names); its soft-caps and window
are in the metadata, its query scale is llama.cpp's (1/sqrt(hidden / heads) for the 46-layer 27B).
Phi-3 (``phi3``) keeps HF's fused ``attn_qkv`` and ``ffn_up`` (= gate_up_proj); longrope's factors are
the tensors ``rope_factors_short`` / ``rope_factors_long``, its cos/sin scale and original length
are metadata.
GPT-2 (``gpt2``) maps back to HF's own names (``transformer.wte``, ``transformer.h.N.attn.c_attn``,
...), with the learned positions as ``position_embd`` and the ``Conv1D`` weights llama.cpp transposed
turned back to HF's ``[in, out]``; the tokenizer is the file's byte-level BPE.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import transformers

from steerable.layers.checkpoint import CheckpointTensor
from steerable.models.gguf_file import GGUFFile, GGUFTensor

logger = logging.getLogger(__name__)

# GGUF architecture -> (HF config class name, HF architecture, q/k rows permuted by llama.cpp's converter).
# Mistral GGUFs are llama-structured (llama.cpp converts them as such), so they load as Llama.
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", True),
    "mistral": ("LlamaConfig", "LlamaForCausalLM", True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", False),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", False),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", False),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", False),
}
_NORM_PLUS_ONE = ("gemma2", "gemma3")  # llama.cpp stores these families' norm weights as 1 + w

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
# Gemma's sandwich norms: ffn_norm is the pre-feedforward norm there, and two post-norms follow.
_GEMMA3_PER_LAYER = {**_PER_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                     "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections: ffn_up holds gate_up_proj (gate rows first), attn_qkv holds q|k|v.
_PHI3_PER_LAYER = {**_PER_LAYER, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# GPT-2 keeps HF's own names (``transformer.``, its Conv1D modules); its norms have biases too.
_GPT2_TOP_LEVEL = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                   "output_norm": "transformer.ln_f", "output": "lm_head"}
_GPT2_PER_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                   "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
# llama.cpp transposes these Conv1D weights ([in, out] in HF) to [out, in]; HF's layout comes back
# by transposing again, unread, so a tensor-parallel rank still reads only its rows of the file.
_GPT2_CONV1D = (".attn_qkv.weight", ".attn_output.weight", ".ffn_up.weight", ".ffn_down.weight")
_PER_LAYER_BY_ARCH = {"gemma2": _GEMMA3_PER_LAYER, "gemma3": _GEMMA3_PER_LAYER, "phi3": _PHI3_PER_LAYER,
                      "gpt2": _GPT2_PER_LAYER}
_TOP_LEVEL_BY_ARCH = {"gpt2": _GPT2_TOP_LEVEL}
_LAYER_PREFIX = {"gpt2": "transformer.h"}
_GEMMA2_27B_LAYERS = 46
_PHI3_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
# What llama.cpp hard-codes for Gemma 3 (``llama_load_hparams`` for LLM_ARCH_GEMMA3), by block count:
# the window of sizes without one in the file (270M, 1B: 512; 4B and up: 1024), global every 6th layer,
# local RoPE base 10k, and 27B's query scale 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim).
_GEMMA3_WINDOW = {18: 512, 26: 512}
_GEMMA3_DEFAULT_WINDOW = 1024
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10_000.0
_GEMMA3_27B_LAYERS = 62
# Tensors that carry no HF parameter (rope_freqs is folded into the config's rope parameters).
_NON_PARAMETERS = {"rope_freqs.weight", *_PHI3_ROPE_FACTORS}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@functools.lru_cache(maxsize=2)
def _reader(path: str) -> GGUFFile:
    """The file's metadata and a memory map of its tensors; config and weights share one parse."""
    return GGUFFile(path)


def _arch(reader: GGUFFile) -> str:
    arch = reader.get("general.architecture")
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


def _rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Translate ``{arch}.rope.scaling.*`` (or a llama3 ``rope_freqs`` tensor) into HF rope parameters."""
    p = f"{arch}.rope.scaling."
    kind = reader.get(p + "type")
    if kind == "none":
        return None
    if kind is None:
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is None:
            return None
        return _llama3_from_rope_freqs(_read(freqs, tuple((0, n) for n in freqs.shape)).numpy().reshape(-1), theta,
                                       head_dim)
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(reader.get(p + "factor", 1.0))}
    orig = reader.get(p + "original_context_length")
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
        if (value := reader.get(p + gguf_key)) is not None:
            scaling[hf_key] = float(value)
    return scaling


def load_gguf_config(path: str) -> transformers.PretrainedConfig:
    """Build the HF config a GGUF file implies, so the engine sizes its model from the file alone."""
    reader = _reader(path)
    arch = _arch(reader)
    cls_name, hf_arch, _ = _ARCHS[arch]
    config_cls = getattr(transformers, cls_name)

    def key(name: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{name}", default)

    def required(name: str) -> int:
        """A size the model cannot be built without: its absence is the file's fault, said so."""
        if (value := key(name)) is None:
            raise ValueError(f"{path}: the GGUF metadata key {arch}.{name} is missing")
        return int(value)

    names = {t.name: t for t in reader.tensors}
    if arch == "gpt2":
        return config_cls(**_gpt2_config(reader, key, required, names))
    hidden, n_heads = required("embedding_length"), required("attention.head_count")
    head_dim = key("attention.key_length") or (key("rope.dimension_count") if _ARCHS[arch][2] else None)
    head_dim = int(head_dim or hidden // n_heads)
    theta = float(key("rope.freq_base", 10000.0))
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=_vocab_size(reader, key, names),
        hidden_size=hidden,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=required("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        **_special_token_ids(reader),
    )
    if arch != "qwen2":  # Qwen2 always has q/k/v bias; the others only when the file carries one
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    if arch == "gemma2":
        kwargs.update(_gemma2_config(key, kwargs))
    if arch == "phi3":
        kwargs.update(_phi3_config(reader, key, kwargs))
        scaling = _phi3_longrope(reader, key, names)
    if arch == "gemma3":
        kwargs.update(_gemma3_config(key, kwargs), rope_theta=theta, rope_scaling=scaling)
    # transformers 5 keeps theta (and scaling) in rope_parameters; 4.x takes rope_theta + rope_scaling.
    elif "rope_parameters" in inspect.signature(config_cls).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    else:
        kwargs.update(rope_theta=theta, rope_scaling=scaling)
    return config_cls(**kwargs)


def _vocab_size(reader: GGUFFile, key, names: dict[str, GGUFTensor]) -> int:
    """The file's vocabulary size, else the embedding's rows (what the weights need), else the token list."""
    vocab = key("vocab_size")
    if vocab is None:
        embd = names.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else len(reader.get("tokenizer.ggml.tokens", ()))
    return int(vocab)


def _special_token_ids(reader: GGUFFile) -> dict[str, int]:
    ids = {}
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if (token_id := reader.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            ids[hf_key] = int(token_id)
    return ids


def _gpt2_config(reader: GGUFFile, key, required, names: dict[str, GGUFTensor]) -> dict[str, Any]:
    """GPT-2's config under its own HF names. llama.cpp writes ``feed_forward_length`` as 4 * n_embd
    whatever ``n_inner`` is, and ``context_length`` from ``n_ctx``: the MLP width and the number of
    learned positions come from the tensors, which are what the weights need. (GELU-new and the
    attention scale are not in the file; llama.cpp fixes them to GPT-2's, as here.)"""
    for tensor in ("token_embd.weight", "position_embd.weight", "blk.0.ffn_up.weight"):
        if tensor not in names:
            raise ValueError(f"GGUF gpt2: tensor {tensor!r} is missing")
    return dict(
        architectures=[_ARCHS["gpt2"][1]],
        vocab_size=_vocab_size(reader, key, names),
        n_embd=required("embedding_length"),
        n_layer=required("block_count"),
        n_head=required("attention.head_count"),
        n_positions=int(names["position_embd.weight"].shape[0]),
        n_inner=int(names["blk.0.ffn_up.weight"].shape[0]),
        layer_norm_epsilon=float(key("attention.layer_norm_epsilon", 1e-5)),
        activation_function="gelu_new",
        tie_word_embeddings="output.weight" not in names,
        **_special_token_ids(reader),
    )


def _gemma3_config(key, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config keys the file leaves out, from the family values llama.cpp uses."""
    layers = kwargs["num_hidden_layers"]
    window = key("attention.sliding_window")
    if window is None:
        window = _GEMMA3_WINDOW.get(layers, _GEMMA3_DEFAULT_WINDOW)
        logger.info("GGUF gemma3: no sliding window in the file; using the family's %d", window)
    scalar = kwargs["head_dim"]
    if layers == _GEMMA3_27B_LAYERS:
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    types = ["full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(layers)]
    return dict(sliding_window=int(window), layer_types=types, query_pre_attn_scalar=scalar,
                rope_local_base_freq=_GEMMA3_LOCAL_THETA)


def _gemma2_config(key, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's soft-caps and window from the metadata; its query scale as llama.cpp computes it."""
    scalar = kwargs["head_dim"]
    if kwargs["num_hidden_layers"] == _GEMMA2_27B_LAYERS:
        scalar = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    window = key("attention.sliding_window")
    return dict(attn_logit_softcapping=key("attn_logit_softcapping"),
                final_logit_softcapping=key("final_logit_softcapping"), query_pre_attn_scalar=scalar,
                **({} if window is None else {"sliding_window": int(window)}))


def _phi3_config(reader: GGUFFile, key, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's window (0 in the file: none) and the original context length longrope scales from."""
    window = key("attention.sliding_window")
    original = reader.get("phi3.rope.scaling.original_context_length")
    return dict(sliding_window=int(window) if window else None,
                **({} if original is None else {"original_max_position_embeddings": int(original)}))


def _phi3_longrope(reader: GGUFFile, key, names: dict[str, GGUFTensor]) -> dict[str, Any] | None:
    """Longrope parameters from the factor tensors and metadata (None: plain RoPE)."""
    if _PHI3_ROPE_FACTORS[0] not in names:
        return None
    original = key("rope.scaling.original_context_length")
    if original is None:
        raise ValueError("GGUF phi3: rope factor tensors without phi3.rope.scaling.original_context_length")
    short, long = (_read(names[n], tuple((0, d) for d in names[n].shape)).float().reshape(-1).tolist()
                   for n in _PHI3_ROPE_FACTORS)
    scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                               "original_max_position_embeddings": int(original)}
    if (attn_factor := key("rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def _hf_name(gguf_name: str, arch: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    top = _TOP_LEVEL_BY_ARCH.get(arch, _TOP_LEVEL)
    if stem in top and suffix in ("weight", "bias"):
        return f"{top[stem]}.{suffix}"
    per_layer = _PER_LAYER_BY_ARCH.get(arch, _PER_LAYER)
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in per_layer:
        return f"{_LAYER_PREFIX.get(arch, 'model.layers')}.{m.group(1)}.{per_layer[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unrecognised GGUF tensor {gguf_name!r}")


def _read(tensor: GGUFTensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The ``box`` of a GGUF tensor in HF layout. A matrix's rows are cut from the memory map before
    dequantizing, and its columns too where they fall on quantization-block boundaries: a tensor-
    parallel rank pages in only its part."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES

    kind = T(tensor.ggml_type)
    plain = {T.F32: (1, 4), T.F16: (1, 2), T.BF16: (1, 2)}  # (elements, bytes) per stored block
    block, type_size = plain[kind] if kind in plain else GGML_QUANT_SIZES[kind]
    shape = tensor.shape
    data = tensor.data.reshape(-1, shape[-1] // block * type_size)  # one stored row per HF row
    if len(shape) != 2:  # vectors (norms, biases) are small: decode whole, then cut
        return _decode(kind, data, tensor.name).reshape(shape)[tuple(slice(a, b) for a, b in box)]
    (r0, r1), (c0, c1) = box
    rows = data[r0:r1]
    if c0 % block == 0 and c1 % block == 0:
        return _decode(kind, rows[:, c0 // block * type_size:c1 // block * type_size], tensor.name)
    return _decode(kind, rows, tensor.name)[:, c0:c1]


def _decode(kind: Any, raw: np.ndarray, name: str) -> torch.Tensor:
    """Stored rows (bytes) -> a tensor of those rows: float32, or the file's own 16-bit type."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    raw = np.array(raw)  # a copy out of the (read-only) memory map
    if kind == T.F32:
        return torch.from_numpy(raw.view(np.float32))
    if kind == T.F16:
        return torch.from_numpy(raw.view(np.float16))
    if kind == T.BF16:  # reinterpret the raw bytes so a bf16 target skips the fp32 round trip
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    try:
        return torch.from_numpy(dequantize(raw, kind)).reshape(len(raw), -1)
    except NotImplementedError:
        raise ValueError(f"unsupported GGUF tensor type {kind.name} for {name!r}") from None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotate-half -> interleaved pairs) to get HF's layout back.

    The converter stored ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is its inverse.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _slice(tensor: GGUFTensor, dtype: torch.dtype, permuted_heads: int | None, norm_offset: bool) -> CheckpointTensor:
    def read(box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        w = _read(tensor, box)
        if permuted_heads:  # the permutation stays inside each head's rows: a slice of whole heads undoes alone
            head_rows = tensor.shape[0] // permuted_heads
            start, stop = box[0]
            if start % head_rows or stop % head_rows:
                raise ValueError(f"{tensor.name}: rows [{start}, {stop}) do not cover whole heads of {head_rows} rows")
            w = _unpermute(w, (stop - start) // head_rows)
        if norm_offset:
            w = w.float() - 1  # stored as 1 + w (see the module docstring)
        return w.to(dtype)

    return CheckpointTensor(tensor.shape, read)


def iter_gguf_slices(path: str, dtype: torch.dtype, num_heads: int = 0,
                     num_kv_heads: int = 0) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(hf_name, tensor)`` pairs, each tensor read (dequantized, q/k un-permuted with the
    head counts, Gemma's norm offset removed) only when loaded and only in the part loaded: a
    rank's shard, or all of it.

    ``lm_head.weight`` is only yielded when the file has its own ``output.weight`` (i.e. not tied).
    """
    reader = _reader(path)
    arch = _arch(reader)
    permuted = _ARCHS[arch][2]
    for tensor in reader.tensors:
        if tensor.name in _NON_PARAMETERS:
            continue
        heads = None
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = num_heads if ".attn_q." in tensor.name else num_kv_heads
        offset = arch in _NORM_PLUS_ONE and tensor.name.endswith("norm.weight")
        sliced = _slice(tensor, dtype, heads, offset)
        if arch == "gpt2" and tensor.name.endswith(_GPT2_CONV1D):
            sliced = sliced.t()
        yield _hf_name(tensor.name, arch), sliced


def iter_gguf_tensors(path: str, config: transformers.PretrainedConfig | None,
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor read whole, one at a time (peak memory is one dequantized tensor)."""
    heads = (config.num_attention_heads, config.num_key_value_heads) if config is not None else (0, 0)
    for name, tensor in iter_gguf_slices(path, dtype, *heads):
        yield name, tensor.load()


def load_gguf_tokenizer(path: str):
    """Let transformers rebuild the tokenizer from the GGUF's embedded vocab, merges and chat template.

    That conversion takes about a minute for a 262k-token vocabulary (Gemma 3), so its result is
    kept as a tokenizer directory under the user cache, keyed by the file and the transformers
    version; later loads read that in seconds. Without a writable cache it is simply rebuilt."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = os.path.abspath(path)
    cached = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    partial = f"{cached}.tmp{os.getpid()}"
    try:
        tokenizer.save_pretrained(partial)
        os.replace(partial, cached)
    except OSError as err:  # read-only home, or another process cached it first
        shutil.rmtree(partial, ignore_errors=True)
        logger.info("not caching the GGUF tokenizer at %s: %s", cached, err)
    return tokenizer


def _tokenizer_cache_dir(path: str) -> str:
    stat = os.stat(path)
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "steerable", "gguf-tokenizers", hashlib.blake2b(key, digest_size=12).hexdigest())
