"""Tiny random checkpoints of every supported family, saved the way HF saves real ones, plus a
tokenizer trained locally with `tokenizers`; HF transformers on the same files is the oracle."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Tiny models: one intra-op thread is as fast and immune to oversubscription on shared CPUs.
torch.set_num_threads(1)
os.environ.setdefault("STEERABLE_CPU_THREADS", "1")  # engines and the servers tests start do the same

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and importlib.util.find_spec("triton"):
    # Triton's CPU interpreter (<= 3.6 at least) converts loop bounds with int(array_of_shape_1),
    # which NumPy >= 2.4 rejects; take the single element explicitly. Test-only shim.
    from triton.runtime import interpreter as _interp

    _patch_lang_tensor = _interp._patch_lang_tensor

    def _patched(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patched

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Steering vectors shift the residual stream of a language model.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill and decode tokens in one step.",
    "Hello world! How are you today? I am fine, thank you.",
    "Capture every hidden state and label it with its request and position.",
    "Numbers like 12345 and 67890 appear in text too.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Steering",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching mixes prefill",
    "Numbers like 12345",
    "Capture every hidden state and label it with its request and position. Hello world! How are you",
    "a",
    "The lazy dog jumps over the quick brown fox and then the fox jumps over the dog again and again",
]


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<unk>", "<s>", "</s>", "<|user|>",
                                                                  "<|assistant|>", "<|system|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _longrope(half: int) -> dict:
    g = torch.Generator().manual_seed(5)
    return {"rope_type": "longrope", "attention_factor": 1.1, "original_max_position_embeddings": 512,
            "short_factor": (1 + 3 * torch.rand(half, generator=g)).tolist(),
            "long_factor": (4 + 20 * torch.rand(half, generator=g)).tolist()}


LONGROPE = _longrope(8)  # head_dim 16 (hidden 64 over 4 heads)
_UNUSED_BY_LAYERNORM_FAMILIES = ("num_key_value_heads", "rms_norm_eps", "intermediate_size")

FAMILIES = {
    "llama": dict(cls="LlamaConfig", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, tie_word_embeddings=False)),
    "mistral": dict(cls="MistralConfig", extra=dict(sliding_window=24, tie_word_embeddings=False)),
    "qwen2": dict(cls="Qwen2Config", extra=dict(tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3Config", extra=dict(head_dim=32, tie_word_embeddings=True)),
    # A window shorter than the prompts, two local layers then a global one (Gemma stacks end with a
    # global layer), a query scale that is not head_dim's, linear RoPE scaling on the global layer
    # (as 4B and up), random (1 + w) norms.
    "gemma3": dict(cls="Gemma3TextConfig", own_rope=True, random_norms=True, extra=dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, tie_word_embeddings=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # Soft-caps small enough to bite on these weights, alternating local (window 8) / global layers
    # (four, so that the stack ends with a global layer, as Gemma 2's do).
    "gemma2": dict(cls="Gemma2Config", random_norms=True, extra=dict(
        num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=4.0, tie_word_embeddings=True)),
    # Norms after the blocks and over the whole q/k projections, given values so a per-head norm would show.
    "olmo2": dict(cls="Olmo2Config", random_norms=True, norm_mean=1.0, extra=dict(tie_word_embeddings=False)),
    # Fused qkv / gate-up checkpoints and longrope: short factors (the engine's max_model_len fits the
    # original length) that are not one, and a cos/sin scale.
    "phi3": dict(cls="Phi3Config", own_rope=True, extra=dict(
        tie_word_embeddings=False, original_max_position_embeddings=512, rope_scaling=LONGROPE)),
    # LayerNorm families: random LayerNorm weights and biases, and random biases in every linear
    # layer (HF initialises them to 1 / 0), so a dropped bias or a norm without one would show.
    # GPT-2: tied head, learned positions (n_positions is max_position_embeddings), gelu_new.
    # (init_scale: at the shared scale its random stack repeats one token; larger weights vary.)
    "gpt2": dict(cls="GPT2Config", layer_norm=True, no_rope=True, init_scale=2.5, drop=_UNUSED_BY_LAYERNORM_FAMILIES,
                 extra=dict(n_inner=128, layer_norm_epsilon=1e-5)),
    # Pythia's layout: parallel residual, a quarter of each head rotated, exact GELU, untied head.
    "gpt_neox": dict(cls="GPTNeoXConfig", own_rope=True, layer_norm=True, drop=("num_key_value_heads", "rms_norm_eps"),
                     extra=dict(rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                                hidden_act="gelu", layer_norm_eps=1e-5, tie_word_embeddings=False)),
    # The flag's other value (sequential residual, as GPT-J-style NeoX checkpoints), tied, half rotated.
    "gpt_neox_seq": dict(cls="GPTNeoXConfig", own_rope=True, layer_norm=True,
                         drop=("num_key_value_heads", "rms_norm_eps"),
                         extra=dict(rotary_pct=0.5, rotary_emb_base=10000, use_parallel_residual=False,
                                    hidden_act="gelu_new", layer_norm_eps=1e-5, tie_word_embeddings=True)),
}


def _set_rope(config, theta: float, scaling: dict | None) -> None:
    """RoPE theta and scaling in the form the installed transformers keeps them."""
    if isinstance(getattr(config, "rope_parameters", None), dict):
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    else:
        config.rope_theta = theta
        config.rope_scaling = scaling


def build_model(family: str, path: str, vocab_size: int, seed: int = 0, init: float = 0.15,
                spec: dict | None = None) -> None:
    """A tiny random checkpoint of ``family`` (``spec``: a FAMILIES-style entry of a variant)."""
    import transformers

    spec = spec if spec is not None else FAMILIES[family]
    extra = dict(spec["extra"])
    rope = extra.pop("rope_scaling", None)
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  initializer_range=init * spec.get("init_scale", 1.0))
    kwargs.update(extra)
    for key in spec.get("drop", ()):
        kwargs.pop(key)
    own_rope = spec.get("own_rope", False)  # the config class converts its RoPE keyword arguments itself
    if own_rope and rope is not None:
        kwargs["rope_scaling"] = rope
    config = getattr(transformers, spec["cls"])(**kwargs)
    if not own_rope and not spec.get("no_rope"):
        _set_rope(config, 10000.0, rope)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.get("random_norms"):
        with torch.no_grad():  # HF initialises norms at w = 0 or 1: give w values so the weights matter
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(spec.get("norm_mean", 0.0), 0.3)
    if spec.get("layer_norm"):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.2)
                elif param.dim() == 1:  # LayerNorm weights around 1
                    param.normal_(1, 0.2)
    if family == "qwen2":
        with torch.no_grad():  # give the qkv biases values so a dropped bias would show
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    build_tokenizer(path)


def build_family_dirs(root, init: float, seed: int) -> dict[str, str]:
    """One tiny checkpoint per family (plus the shared tokenizer) under ``root``."""
    tok_dir = str(root / "tokenizer")
    build_tokenizer(tok_dir)
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    dirs = {}
    for i, family in enumerate(FAMILIES):
        dirs[family] = str(root / family)
        build_model(family, dirs[family], vocab, seed=seed + i, init=init)
    return dirs


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Large random weights: peaked output distributions, so steering visibly changes tokens."""
    return build_family_dirs(tmp_path_factory.mktemp("models"), init=0.15, seed=0)


@pytest.fixture(scope="session")
def capture_dirs(tmp_path_factory) -> dict[str, str]:
    """Same families with activations of order one, so float32 noise stays far below 1e-5 and
    captured values can be compared to HF with an absolute tolerance."""
    return build_family_dirs(tmp_path_factory.mktemp("capture_models"), init=0.04, seed=10)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def smollm2_gguf() -> str | None:
    from steerable.models.loader import demo_model_path
    return demo_model_path("smollm2")


@pytest.fixture(scope="session")
def server(model_dirs, tmp_path_factory):
    """One ``steerable serve`` of the tiny Qwen3 shared by every server test (see server_harness)."""
    from server_harness import serve_test_model

    with serve_test_model(model_dirs["qwen3"], str(tmp_path_factory.mktemp("server") / "server.log")) as running:
        yield running
    assert running.proc.returncode is not None  # no server process outlives the tests


@pytest.fixture(scope="module")
def http(server):
    """A client of the shared server (long timeout: training and sweeps run on two CPU cores)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(model_dirs):
    """The served model in this process: the oracle every server response is compared with."""
    from steerable import LLM

    return LLM(model_dirs["qwen3"], device="cpu", kv_cache_tokens=8192)


@pytest.fixture(scope="session")
def bench_cache_dir(tmp_path_factory) -> str:
    """Where the benchmarks' random checkpoints are built, once for every benchmark test file."""
    return str(tmp_path_factory.mktemp("bench-cache"))
