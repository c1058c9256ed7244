"""Shared pieces of the benchmarks: models of known shapes, workloads, timing, the records.

A random-weight checkpoint of a known shape (Qwen3-0.6B by
default; ``--shape qwen3-8b`` for the tensor/pipeline-parallel targets; ``gemma3-270m`` or
``gemma3-4b`` for Gemma 3's text models, ``gemma2-2b`` for Gemma 2's, ``gpt2`` for GPT-2 small,
whose 1024 positions cap the workload's lengths at 512 in and 512 out; built once, cached) or, with ``--shape qwen3-30b-a3b``, a
Qwen3-30B-A3B-shaped MoE whose 61 GB of random bf16 weights are drawn on the device
(``load_format="dummy"``: the checkpoint would not fit the disk), a seeded workload of token-id
prompts, CUDA-synchronised timing and JSON-line output.

Every benchmark prints JSON lines on stdout only (one record each, ``{"bench": ..., "record": ...}``),
the run's header first, appends them to the results store (``benchmarks/results.py``) and runs
the baseline it is compared with in the same process, so ratios survive shared machines.
``--smoke`` swaps in a tiny random model of the same family and a handful of short requests so
everything runs on a CPU in seconds (the tests use it); its records go to stdout only."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import provenance

DEFAULT_CACHE = "/tmp/steerable-bench"
_OUT: str | None = None
_BENCH = "bench"

# Qwen3-0.6B's shape (DESIGN.md §6), Gemma 3 270M's and 4B's text models, and the tiny ones --smoke uses.
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 bos_token_id=151643, eos_token_id=151645)
QWEN3_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2)
# Qwen3-30B-A3B's shape (every layer sparse: 128 experts, 8 per token) and a tiny one for --smoke.
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645,
                     tie_word_embeddings=False)
QWEN3_MOE_SMOKE = dict(QWEN3_SMOKE, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
# Qwen3-8B's shape (the tensor/pipeline-parallel targets, DESIGN.md §6): untied head, 36 layers.
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                bos_token_id=151643, eos_token_id=151645, tie_word_embeddings=False)
# Gemma 3: every sixth layer global (pattern default), local RoPE base 10k, global 1M (linear x8 from 4B up).
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   sliding_window=512, query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1)
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                 sliding_window=1024, query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
GEMMA3_SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                    sliding_window=8, query_pre_attn_scalar=32, bos_token_id=2, eos_token_id=1)
# Gemma 2 2B: sliding (4096) and global layers alternating, soft-caps 50 (attention) and 30 (logits).
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                 sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1)
GEMMA2_SMOKE = dict(GEMMA3_SMOKE, num_hidden_layers=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
# GPT-2 small (124M): learned positions, so a request's prompt and output must fit n_positions.
GPT2_124M = dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024, bos_token_id=50256,
                 eos_token_id=50256)
GPT2_SMOKE = dict(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2)
# --shape -> (transformers config class, full shape, --smoke shape)
SHAPES = {"qwen3-0.6b": ("Qwen3Config", QWEN3_06B, QWEN3_SMOKE),
          "qwen3-8b": ("Qwen3Config", QWEN3_8B, QWEN3_SMOKE),
          "gemma3-270m": ("Gemma3TextConfig", GEMMA3_270M, GEMMA3_SMOKE),
          "gemma3-4b": ("Gemma3TextConfig", GEMMA3_4B, GEMMA3_SMOKE),
          "gemma2-2b": ("Gemma2Config", GEMMA2_2B, GEMMA2_SMOKE),
          "qwen3-30b-a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B, QWEN3_MOE_SMOKE),
          "gpt2": ("GPT2Config", GPT2_124M, GPT2_SMOKE)}
# The longest input (and output) length a shape's workload may draw: both must fit its positions.
SHAPE_MAX_LEN = {"gpt2": 512}


# ---------------------------------------------------------------- model

def _config(config_name: str, shape: dict):
    """The HF config of a shape: Qwen3 with RoPE base 1M, Gemma 3 (its RoPE keys in ``shape``) or
    Gemma 2 (RoPE base 10k)."""
    import transformers

    cls = getattr(transformers, config_name)
    if config_name == "GPT2Config":  # no RoPE; tied head
        return cls(**shape, initializer_range=0.02, architectures=["GPT2LMHeadModel"])
    if config_name == "Gemma3TextConfig":  # takes the flat RoPE keys and builds its per-layer-type table
        return cls(**shape, rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   architectures=["Gemma3ForCausalLM"])
    gemma2 = config_name == "Gemma2Config"
    config = cls(**{"tie_word_embeddings": True, **shape}, rms_norm_eps=1e-6, initializer_range=0.02,
                 architectures=["Gemma2ForCausalLM" if gemma2 else "Qwen3ForCausalLM"])
    theta = 1e4 if gemma2 else 1e6
    if isinstance(getattr(config, "rope_parameters", None), dict):  # transformers >= 5
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        config.rope_theta = theta
    return config


def build_random_model(path: str, config_name: str, shape: dict, seed: int = 0) -> str:
    """Save a random-weight model (bf16 safetensors, no tokenizer) at ``path`` unless one is there.
    Weights are initialised on the GPU when there is one: 0.6B parameters on a CPU take a while."""
    if os.path.exists(os.path.join(path, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(path)):
        return path
    import transformers

    config = _config(config_name, shape)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    # Unit norms: weight 1, or 0 where the norm scales by (1 + weight) (Gemma).
    unit = 0.0 if config_name in ("Gemma3TextConfig", "Gemma2Config") else 1.0
    try:
        with torch.device(device), torch.no_grad():
            model = transformers.AutoModelForCausalLM.from_config(config)
            for name, p in model.named_parameters():  # explicit: N(0, 0.02) matrices, unit norms
                if "norm" in name or ".ln_" in name:  # GPT-2's LayerNorms: ln_1, ln_2, ln_f (bias 0)
                    p.fill_(0.0 if name.endswith("bias") else unit)
                else:
                    p.normal_(0.0, 0.02)
    finally:
        torch.set_default_dtype(previous)
    model.config.dtype = torch.bfloat16
    tmp = f"{path}.tmp{os.getpid()}"  # build beside, then rename: a crash leaves no half checkpoint
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    del model
    free_cuda()  # the engine sizes its KV cache from free GPU memory
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_config_only(path: str, shape: dict) -> str:
    """A Qwen3-MoE directory holding only ``config.json`` (weights come from ``load_format="dummy"``)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**shape, rms_norm_eps=1e-6, initializer_range=0.02, architectures=["Qwen3MoeForCausalLM"])
    if isinstance(getattr(config, "rope_parameters", None), dict):  # transformers >= 5
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}
    else:
        config.rope_theta = 1e6
    config.dtype = torch.bfloat16
    config.save_pretrained(path)
    return path


def model_path(args: argparse.Namespace) -> str:
    """The checkpoint to load; sets ``args.load_format`` ("dummy" for a config-only shape)."""
    args.load_format = "auto"
    if args.model:
        return args.model
    config_name, full, smoke = SHAPES[args.shape]
    shape = smoke if args.smoke else full
    name = f"{args.shape}-smoke-random" if args.smoke else f"{args.shape}-random"
    if config_name == "Qwen3MoeConfig":  # config only: the weights are drawn on the device
        args.load_format = "dummy"
        return build_config_only(os.path.join(args.cache_dir, f"{name}-config"), shape)
    return build_random_model(os.path.join(args.cache_dir, name), config_name, shape)


def make_llm(args: argparse.Namespace, path: str, **overrides: Any):
    """The engine under test, configured from the common flags (``overrides`` on top, e.g. the
    parallel sizes or ``enforce_eager``); its load time is a record."""
    from steerable import LLM

    kwargs = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_tokens=args.kv_cache_tokens,
                  enforce_eager=args.enforce_eager, seed=args.seed, load_format=args.load_format,
                  kv_cache_dtype=args.kv_cache_dtype)
    kwargs.update(overrides)
    llm, seconds = timed(lambda: LLM(path, **kwargs))
    emit({"record": "llm_init", "seconds": seconds, "dtype": str(llm.engine.dtype).removeprefix("torch."),
          "device": str(llm.engine.device), "enforce_eager": kwargs["enforce_eager"],
          "kv_cache_dtype": args.kv_cache_dtype, **{k: v for k, v in overrides.items() if k != "enforce_eager"}})
    return llm


def prompt_vocab(llm) -> int:
    """Token ids the prompts may use: the model's vocabulary, capped by its tokenizer if it has one
    (padded embedding rows have no token, and the detokenizer sees the prompt tail)."""
    vocab = llm.engine.model_config.vocab_size
    tok = llm.get_tokenizer()
    return min(vocab, len(tok)) if tok is not None else vocab


# ---------------------------------------------------------------- workload

@dataclass
class Workload:
    prompts: list[list[int]]
    input_lens: list[int]
    output_lens: list[int]

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, k: int) -> Workload:
        return Workload(self.prompts[:k], self.input_lens[:k], self.output_lens[:k])


def workload(num_requests: int, seed: int, min_len: int = 100, max_len: int = 1024, vocab: int = 151936) -> Workload:
    """Random token-id prompts; input and output lengths uniform in [min_len, max_len] (seeded)."""
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(min_len, max_len + 1, num_requests).tolist()
    output_lens = rng.integers(min_len, max_len + 1, num_requests).tolist()
    prompts = [rng.integers(0, vocab, n).tolist() for n in input_lens]
    return Workload(prompts, input_lens, output_lens)


def sampling_params(w: Workload, salt: str, extra: list[dict] | None = None, **kwargs: Any) -> list:
    """One SamplingParams per request (temperature 0.6, ignore_eos, max_tokens = its output length,
    plus ``extra[i]``). ``salt`` keeps timed runs of the same prompts off each other's prefix cache."""
    from steerable import SamplingParams

    base = dict(temperature=0.6, ignore_eos=True, cache_salt=salt, **kwargs)
    return [SamplingParams(max_tokens=n, **base, **(extra[i] if extra else {})) for i, n in enumerate(w.output_lens)]


def warm_up(llm, w: Workload, args: argparse.Namespace, salt: str = "warmup", extra: list[dict] | None = None) -> None:
    """The workload's own prompts (default: as many as the batch holds) with short outputs ending one
    after another: every prefill chunk shape and every decode batch size, down to a single request,
    runs once, so lazily captured CUDA graphs, kernel specialisations (Triton compiles a variant for
    a batch of one) and first GEMM calls are paid before timing."""
    n = min(len(w), args.warmup_requests or args.max_num_seqs)
    tail = min(n, 8)  # the last ones finish one per step: batches of 8, 7, ..., 1
    outputs = [1 + i * 32 // n if i < n - tail else 33 + i - (n - tail) for i in range(n)]
    short = Workload(w.prompts[:n], [], outputs)
    llm.generate(short.prompts, sampling_params(short, salt, extra[:n] if extra else None), use_tqdm=False)


# ---------------------------------------------------------------- memory roofline

def copy_speed(device: torch.device) -> float:
    """Bytes per second a device-to-device copy moves (read + write), on a buffer far larger than
    the caches: the bandwidth a memory-bound decode step can use."""
    size = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    _, seconds = timed(lambda: [dst.copy_(src) for _ in range(10)])
    del src, dst
    free_cuda()
    return 10 * 2 * size / seconds


def weight_bytes_per_step(path: str, dtype: torch.dtype) -> int:
    """Bytes of weights a decode step reads: every parameter, less the embedding table unless the
    LM head is that table (an embedding lookup reads only its rows). Counted on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    if not getattr(config, "tie_word_embeddings", False):
        total -= model.get_input_embeddings().weight.numel()
    return total * dtype.itemsize


def kv_bytes_read(model_config, kv_dtype: torch.dtype, w: "Workload") -> int:
    """Bytes of K and V the decode steps of workload ``w`` read in all: the step producing output
    token t + 1 of a request reads its first ``input_len + t`` positions (within each layer's window)."""
    per_position = 2 * model_config.num_kv_heads * model_config.head_dim * kv_dtype.itemsize
    windows = [model_config.attention_window(layer) for layer in range(model_config.num_layers)]
    total = 0
    for n, out in zip(w.input_lens, w.output_lens):
        ctx = np.arange(n + 1, n + out)  # the decode steps' context lengths
        total += sum(int(np.minimum(ctx, win).sum()) if win else int(ctx.sum()) for win in windows)
    return total * per_position


def roofline(llm, path: str, w: "Workload", seconds: float, steps: int, speed: float) -> dict:
    """Weight + KV bytes per engine step of a run and the step time memory bandwidth alone allows
    (bytes / ``speed``, a copy's bytes per second), next to the measured step time."""
    engine = llm.llm_engine
    kv_dtype = engine.config.resolve_kv_dtype(engine.dtype)
    weights = weight_bytes_per_step(path, engine.dtype)
    kv = kv_bytes_read(engine.model_config, kv_dtype, w) / max(steps, 1)
    bound = (weights + kv) / speed
    measured = seconds / max(steps, 1)
    return {"weight_bytes_per_step": weights, "kv_bytes_per_step": kv, "bytes_per_step": weights + kv,
            "copy_gb_s": speed / 1e9, "roofline_step_ms": bound * 1e3, "measured_step_ms": measured * 1e3,
            "fraction_of_roofline": bound / measured, "steps": steps}


def generated_tokens(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def throughput(seconds: float, input_tokens: int, output_tokens: int) -> dict:
    return {"seconds": seconds, "input_tokens": input_tokens, "output_tokens": output_tokens,
            "output_tok_s": output_tokens / seconds, "total_tok_s": (input_tokens + output_tokens) / seconds}


# ---------------------------------------------------------------- timing and output

def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall seconds), with CUDA synchronised on both sides so queued kernels are counted."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - start


def interleaved(modes: list[str], run: Callable[..., Any], repeats: int) -> dict[str, list[Any]]:
    """``run(mode, salt, warm=True)`` once per mode, then ``repeats`` rounds of ``run(mode, salt)``
    over the modes in turn: alternating, so slow drift of the machine hits every mode alike."""
    for mode in modes:
        run(mode, f"warmup-{mode}", warm=True)
    results: dict[str, list[Any]] = {mode: [] for mode in modes}
    for r in range(repeats):
        for mode in modes:
            results[mode].append(run(mode, f"{mode}-{r}"))
    return results


def median(values: list[float]) -> float:
    return statistics.median(values)


def kernel_timer(bench: str, smoke: bool) -> tuple[Callable[[Callable[[], Any]], float], str, torch.dtype]:
    """(microseconds of one call, device, dtype) for a kernel sweep: CUDA-graph replays in bf16 on a
    GPU; wall clock in float32 on a CPU, allowed only with ``--smoke`` (it checks the script, not
    the kernel's speed)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench_cudagraph

        return (lambda fn: do_bench_cudagraph(fn) * 1e3), "cuda", torch.bfloat16
    if not smoke:
        raise SystemExit(f"{bench} times GPU kernels: run it on a CUDA machine (or --smoke on a CPU)")
    return (lambda fn: timed(fn)[1] * 1e6), "cpu", torch.float32


def emit(record: dict) -> None:
    """One JSON line on stdout (flushed), also appended to the run's results file when it has one."""
    line = json.dumps({"bench": _BENCH, **record}, default=str)
    print(line, flush=True)
    if _OUT:
        with open(_OUT, "a") as f:
            f.write(line + "\n")


def free_cuda() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def header(args: argparse.Namespace, path: str | None) -> dict:
    """Print the run's header record (``provenance.describe``) and return it."""
    record = {"record": "header", **provenance.describe(args, path)}
    emit(record)
    return record


# ---------------------------------------------------------------- command line

def parser(description: str) -> argparse.ArgumentParser:
    """Flags every benchmark shares. Defaults left as None are filled by ``setup`` (full or --smoke)."""
    p = argparse.ArgumentParser(prog=provenance.prog(), description=description)
    p.add_argument("--model", default=None, help="an HF checkpoint dir (default: a random model of --shape)")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES),
                   help="the random model's shape when no --model is given (default: qwen3-0.6b)")
    p.add_argument("--smoke", action="store_true", help="tiny random model, few short requests (CPU, seconds)")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where the random checkpoints are kept")
    p.add_argument("--out", default=None,
                   help="where the records go besides stdout: a .jsonl file, or a folder for the default name "
                        "(default: $STEERABLE_BENCH_RESULTS or benchmarks/results/; with --smoke, nowhere); - for none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-len", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--warmup-requests", type=int, default=None, help="default: min(num requests, max_num_seqs)")
    return p


# (full, --smoke) values for flags left unset.
COMMON_DEFAULTS = {"num_requests": (256, 6), "min_len": (100, 4), "max_len": (1024, 16),
                   "kv_cache_tokens": (None, 4096)}


def setup(bench: str, args: argparse.Namespace, defaults: dict | None = None, model: bool = True) -> str | None:
    """Fill defaults (full, smoke), pick the results file, build or find the model (unless
    ``model`` is False), print the header; returns the model path."""
    global _BENCH, _OUT
    if args.max_len is None and not args.smoke and args.shape in SHAPE_MAX_LEN and not args.model:
        args.max_len = SHAPE_MAX_LEN[args.shape]
    for key, (full, smoke) in {**COMMON_DEFAULTS, **(defaults or {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, smoke if args.smoke else full)
    import transformers
    transformers.logging.set_verbosity_error()  # stdout stays JSON; HF chatter would go to stderr anyway
    transformers.utils.logging.disable_progress_bar()
    if args.smoke:  # tiny matrices: one thread is as fast and immune to oversubscription
        torch.set_num_threads(1)
    path = model_path(args) if model else None
    _BENCH, _OUT = bench, provenance.results_file(bench, args)
    header(args, path)
    return path
