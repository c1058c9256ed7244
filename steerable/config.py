"""Engine settings and the normalised view of a Hugging Face model config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from steerable.checks import FLOAT_DTYPES

GPU_STEP_TOKENS = 8192  # vLLM's default token budget of a step
# A CPU step costs about its tokens times the multiply-adds of the linear layers per token, over
# the engine's threads: 128 tokens of SmolLM2-135M take ~0.37 s on one core of the 2-core EPYC box,
# 256 on two about the same. A CPU engine's budget keeps its steps near that, so an abort, or a
# request that just came, waits well under a second for the step in progress.
CPU_STEP_MULTIPLY_ADDS_PER_THREAD = 128 * 135_000_000
CPU_STEP_TOKENS_RANGE = (64, GPU_STEP_TOKENS)


@dataclass
class EngineConfig:
    """The knobs of ``LLM(...)``; defaults follow vLLM."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: GPU_STEP_TOKENS on a GPU, sized by the model on a CPU
    max_model_len: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    attention_backend: str = "auto"
    load_format: str = "auto"  # "dummy": random weights from the config alone (benchmarks of shapes, as vLLM)
    kv_cache_dtype: str = "auto"  # "fp8" (= "fp8_e4m3"): half the KV bytes, per-tensor scales (docs/benchmarks.md)
    revision: str | None = None  # branch, tag or commit of a hub id (default: main)
    gguf_file: str | None = None  # the GGUF file to load from a hub repository or a directory
    # Decode rows holding the same leading KV blocks (prefix cache hits) read them once per step
    # (docs/architecture.md, "Shared-prefix attention"); only where at least this many tokens are
    # shared by at least this many running requests, and only on the Triton backend.
    enable_shared_prefix_attention: bool = True
    shared_prefix_min_tokens: int = 256
    shared_prefix_min_requests: int = 8
    max_n: int | None = None  # completions per request at most (a server's cap; None: no cap)
    max_fanout_seqs: int | None = None  # batch slots one n-request's completions hold at most (None: all)
    cpu_threads: int | None = None  # intra-op threads of a CPU engine (None: the cores free at start; steerable/cpu_threads.py)
    # Host bytes for captured prompt rows of whole KV blocks, served to later captures on a prefix hit
    # (steerable/capture/activation_store.py; docs/capture.md). 0: no store.
    activation_store_bytes: int = 0

    def validate(self) -> None:
        for name in ("revision", "gguf_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if self.dtype not in ("auto", *FLOAT_DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(FLOAT_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}, but CUDA is not available on this machine "
                             "(no GPU, or a CPU build of torch); use device='cpu'")
        if not isinstance(self.enable_shared_prefix_attention, bool):
            raise ValueError(f"enable_shared_prefix_attention must be a bool, got {self.enable_shared_prefix_attention!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "shared_prefix_min_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shared_prefix_min_requests < 2:
            raise ValueError(f"shared_prefix_min_requests must be >= 2, got {self.shared_prefix_min_requests}")
        if self.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got {self.kv_cache_dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must hold at least one block ({self.block_size} tokens)")
        for name in ("max_n", "max_fanout_seqs", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
        value = self.activation_store_bytes
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"activation_store_bytes must be an integer >= 0, got {value!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_step_tokens(self, device: torch.device, model: "ModelConfig", cpu_threads: int = 1) -> int:
        """``max_num_batched_tokens``: as given, else vLLM's 8192 on a GPU and, on a CPU, the power
        of two (64 to 8192) whose step costs ``cpu_threads`` times ``CPU_STEP_MULTIPLY_ADDS_PER_THREAD``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if device.type != "cpu":
            return GPU_STEP_TOKENS
        low, high = CPU_STEP_TOKENS_RANGE
        tokens = CPU_STEP_MULTIPLY_ADDS_PER_THREAD * max(cpu_threads, 1) // max(model.multiply_adds_per_token(), 1)
        return max(low, min(high, 1 << max(tokens.bit_length() - 1, 0)))

    def resolve_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type: the model's, or float8 e4m3 (values / scale, saturated at ±448)."""
        return model_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolve_dtype(self, hf_config: Any, device: torch.device) -> torch.dtype:
        """``auto`` is float32 on CPU (exactness, speed of CPU kernels) and the checkpoint dtype on GPU."""
        if self.dtype != "auto":
            return FLOAT_DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(stored, str):
            stored = FLOAT_DTYPES.get(stored)
        return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


@dataclass
class ModelConfig:
    """The architecture facts the engine and a model need, read once from the HF config by the
    family's config adapter (``models/registry.py`` names one per architecture). Families with
    more knobs subclass it."""

    hf_config: Any
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap) inside attention
    # What the engine chose, set once it has: the weights' and activations' dtype, and the context
    # length it serves (``max_model_len``: at most the positions, at most what the KV cache holds).
    dtype: torch.dtype | None = None
    max_model_len: int | None = None

    # vLLM's accessors (``llm.llm_engine.model_config.get_hidden_size()``), for code written against it.
    def get_hidden_size(self) -> int:
        return self.hidden_size

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_head_size(self) -> int:
        return self.head_dim

    def attention_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention (None: full); families mixing both override it."""
        return self.sliding_window

    def multiply_adds_per_token(self) -> int:
        """Weights a token passes through in the linear layers (attention projections, a gated MLP,
        the LM head): the cost of a token in a step, as an estimate for sizing steps."""
        attention = self.hidden_size * self.head_dim * 2 * (self.num_heads + self.num_kv_heads)
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size) + (
            self.vocab_size * self.hidden_size)

    @property
    def attention_scale(self) -> float:
        """Softmax scale of attention scores."""
        return self.head_dim ** -0.5

    @staticmethod
    def architecture_of(hf_config: Any) -> str:
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.architectures is missing; cannot choose a model implementation")
        return architectures[0]

    @classmethod
    def common(cls, hf_config: Any, eps_name: str = "rms_norm_eps") -> dict[str, Any]:
        """The fields every decoder-only family names the same way (from ``text_config`` when the
        checkpoint is multimodal, keeping the outer config's architecture and EOS ids). ``eps_name``:
        the HF key of the norms' epsilon (``rms_norm_eps`` holds a LayerNorm family's too)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        heads = text.num_attention_heads
        hidden = text.hidden_size
        theta, scaling = rope_parameters(text)
        eos = getattr(hf_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        return dict(
            hf_config=hf_config,
            architecture=cls.architecture_of(hf_config),
            hidden_size=hidden,
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or hidden // heads,
            intermediate_size=getattr(text, "intermediate_size", 0),
            vocab_size=text.vocab_size,
            rms_norm_eps=getattr(text, eps_name),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings",
                                                                                       False))),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )


def rope_parameters(hf_config: Any) -> tuple[float, dict | None]:
    """RoPE theta and scaling from either transformers 4 (``rope_theta``/``rope_scaling``) or 5
    (``rope_parameters``) configs; scaling is None for plain RoPE."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if rope_type == "default":
        return theta, None
    if rope_type not in ("llama3", "linear", "longrope"):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported "
                         "(supported: default, linear, llama3, longrope)")
    scaling["rope_type"] = rope_type
    if rope_type == "longrope":
        _longrope_attention_factor(hf_config, scaling)
    return theta, scaling


def _longrope_attention_factor(hf_config: Any, scaling: dict) -> None:
    """Fill in longrope's original length and cos/sin scale as HF derives them: the scale is
    ``sqrt(1 + ln(factor) / ln(original))``, the factor ``max_position_embeddings / original``
    unless given."""
    for name in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(name), (list, tuple)):
            raise ValueError(f"rope_scaling.{name} must be a list of per-frequency factors for longrope")
    original = scaling.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    scaling["original_max_position_embeddings"] = int(original)
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor") or hf_config.max_position_embeddings / original
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
