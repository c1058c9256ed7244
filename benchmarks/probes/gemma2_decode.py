"""Which decode kernels take Gemma 2 2B's decode steps to 70 % of the byte roofline (issue 47)?

Three parts (``--parts``, all by default), each against today's defaults in the same process:

- ``attention``: ``attention_replay``'s replay of the throughput workload's decode attention (bf16
  cache, every ``--stride``-th step, each layer with its window and soft-cap) under every entry of
  ``CANDIDATES`` (fields of ``triton_paged.CONFIG_WIDE``, which heads wider than 128 take: Gemma 2's
  and Gemma 3's 256), seconds over the workload against the time its K and V bytes take at the
  card's copy speed;
- ``logits``: what a decode step spends from the final hidden states to the sampled tokens, at each
  decode batch size the workload runs (padded to the CUDA-graph ladder, weighted by its steps):
  the LM head (cuBLAS ``F.linear``, and cuBLASLt), the final soft-cap as HF's three PyTorch ops,
  as one kernel (``logit_kernels.softcap_``) and inside the sampler's registers (shipped: the
  fastest on an H100), then the fused sampler at the workload's temperature; beside them the weight
  read's time at copy speed, the decoder layers' GEMMs under cuBLAS and cuBLASLt, and each layer's
  post-attention norm as a kernel of its own or inside the next fused add + norm (shipped likewise,
  ``STEERABLE_FUSE_POST_NORM``);
- ``throughput``: ``throughput.py`` on ``--throughput-shapes`` (Gemma 2 2B and Gemma 3 270M: the
  attention candidates change both) in subprocesses, once with today's defaults and once with the
  winners of the parts above (or ``--env``), set through the environment variables the engine reads
  (``STEERABLE_ATTENTION_CONFIG_WIDE``, ``STEERABLE_FINAL_SOFTCAP``, ``STEERABLE_FUSE_POST_NORM``,
  ``TORCH_BLAS_PREFER_CUBLASLT``); their records go to throughput's own results file, their headers
  name the variables.

The ``choice`` record holds the winners' environment (``--env-file`` also writes it as
``NAME=value`` lines). To ship a winner as the default: the attention fields go into
``CONFIG_WIDE`` in ``steerable/layers/attention_backends/triton_paged.py``, the soft-cap mode and
the norm into ``FINAL_SOFTCAP`` and ``FUSE_POST_NORM`` in ``steerable/models/gemma3.py``; cuBLASLt
would be ``torch.backends.cuda.preferred_blas_library("cublaslt")`` where the engine starts.

    python -m benchmarks gemma2_decode [--parts attention,logits,throughput] [--stride 16]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from steerable.layers import fused, logit_kernels
from steerable.worker.cuda_graphs import CudaGraphRunner

from .. import common, provenance
from ..common import emit
from . import attention_replay

# name -> CONFIG_WIDE fields changed from the shipped ones (64-position tiles, 4 warps, 2 stages). Compiled
# for sm_90 on a CPU (Triton 3.6, the JIT's alignment specialisations), a decode program of Gemma 2's
# heads holds ONE K and V tile buffer in shared memory up to 4 stages: the copy of tile i + 1 is issued
# after tile i's MMAs read the buffer and waited for at the top of the next iteration, so a program
# never overlaps its own copies with its math; only other programs on the SM hide the latency. From 5
# stages the pipeliner double-buffers (8: three buffers). Shared memory, registers and programs per SM:
# 64/4w/2s 76 KB, 191 regs, 2; 32/4w/5s 75 KB, 168, 3; 16/4w/5s 41 KB, 109, 4; 16/4w/8s 58 KB, 3;
# 32/8w/5s 75 KB, 115, 2 (of 8 warps); 64/4w/5s 142 KB, 1.
CANDIDATES = {
    "shipped": {},
    "tile_32": {"decode_tile_n": 32},
    "tile_16_s5": {"decode_tile_n": 16, "decode_num_stages": 5},
    "tile_16_s8": {"decode_tile_n": 16, "decode_num_stages": 8},
    "tile_32_s5": {"decode_tile_n": 32, "decode_num_stages": 5},
    "tile_32_w8_s5": {"decode_tile_n": 32, "decode_num_warps": 8, "decode_num_stages": 5},
    "tile_64_s5": {"decode_tile_n": 64, "decode_num_stages": 5},
    # The split-KV kernel (batches of B * Hkv <= 128 today) double-buffered as well.
    "split_t16_s5": {"split_tile_n": 16, "split_num_stages": 5},
    "tile_16_s5+split_t16_s5": {"decode_tile_n": 16, "decode_num_stages": 5, "split_tile_n": 16,
                                "split_num_stages": 5},
    # Split-KV at every batch size, each sequence cut so that the batch makes at least this many programs.
    "split_all_1k_t32_s5": {"split_kv_max_programs": 1 << 20, "split_kv_target_programs": 1024, "split_tile_n": 32,
                            "split_num_stages": 5},
    "split_all_2k_t16_s5": {"split_kv_max_programs": 1 << 20, "split_kv_target_programs": 2048, "split_tile_n": 16,
                            "split_num_stages": 5},
    "split_all_4k_t16_s5": {"split_kv_max_programs": 1 << 20, "split_kv_target_programs": 4096, "split_tile_n": 16,
                            "split_num_stages": 5},
    "split_all_2k": {"split_kv_max_programs": 1 << 20, "split_kv_target_programs": 2048},
}
SMOKE_CANDIDATES = {"shipped": {}, "tile_16": {"decode_tile_n": 16},
                    "split_all_8": {"split_kv_max_programs": 1 << 20, "split_kv_target_programs": 8, "split_tile_n": 4}}
SOFTCAP_MODES = ("torch", "kernel", "sampler")
TEMPERATURE = 0.6  # the workload's


def decode_batches(w: common.Workload, max_num_seqs: int) -> Counter:
    """Decode steps of the workload per CUDA-graph batch size: step t decodes every request whose
    output is longer than t, padded to the ladder the engine replays."""
    graphs = CudaGraphRunner(max_num_seqs)
    outputs = np.array(w.output_lens)
    steps: Counter = Counter()
    for t in range(1, int(outputs.max())):
        active = int((outputs > t).sum())
        steps[graphs.padded_size(active) or active] += 1
    return steps


def part_attention(args, device: str, speed: float, w: common.Workload) -> dict[str, str]:
    """The replay of every candidate; returns the fastest exact one's fields as the environment
    variable that sets them (none where today's configuration wins)."""
    shape = attention_replay.SMOKE_SHAPE if args.smoke else attention_replay.attention_shape(args.shape)
    candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES
    if args.candidates:
        candidates = {n: candidates[n] for n in ["shipped", *args.candidates.split(",")] if n in candidates}
    model_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    records = []
    for record in attention_replay.replay(shape, candidates, w, args, model_dtype, model_dtype, device, speed):
        emit(record)
        records.append(record)
    tolerance = 0.05 if model_dtype == torch.bfloat16 else 1e-4
    exact = [r for r in records if "error" not in r and r["max_abs_diff_vs_shipped"] <= tolerance]
    best = min(exact, key=lambda r: r["seconds"])["changes"]
    if not best:
        return {}
    name = "STEERABLE_ATTENTION_CONFIG_WIDE" if shape["head_size"] > 128 else "STEERABLE_ATTENTION_CONFIG"
    return {name: ",".join(f"{k}={v}" for k, v in best.items())}


def _timer(device: str):
    if device == "cuda":
        from triton.testing import do_bench_cudagraph

        return lambda fn: do_bench_cudagraph(fn, rep=20) / 1e3
    return lambda fn: common.timed(fn)[1]


def _blas(library: str) -> None:
    if torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library(library)


def part_logits(args, device: str, speed: float, w: common.Workload) -> dict:
    """The logits-to-token chain per soft-cap mode and BLAS library, and the layers' GEMMs; returns
    the winning environment (soft-cap mode, cuBLASLt or not)."""
    config = common.SHAPES[args.shape][2 if args.smoke else 1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hidden, vocab, cap = config["hidden_size"], config["vocab_size"], config.get("final_logit_softcapping") or 30.0
    steps = decode_batches(w, args.max_num_seqs)
    seconds = _timer(device)
    g = torch.Generator().manual_seed(args.seed)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inter = config["intermediate_size"]
    layer_gemms = {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim), "o_proj": (heads * head_dim, hidden),
                   "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
    layer_weights = {name: (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
                     for name, (k, n) in layer_gemms.items()}
    norm_w = torch.randn(hidden, generator=g).to(device, dtype)
    layers = config["num_hidden_layers"]
    libraries = ("cublas", "cublaslt") if device == "cuda" else ("cublas",)

    def at_rows(rows: int) -> dict[str, float]:
        """Seconds of one decode step's pieces at ``rows`` rows."""
        h = torch.randn(rows, hidden, generator=g).to(device, dtype)
        layer_inputs = [(torch.randn(rows, m.shape[1], generator=g).to(device, dtype), m) for m in layer_weights.values()]
        temperature = torch.full((rows,), TEMPERATURE, device=device)
        seeds = torch.arange(rows, device=device)

        def chain(mode: str) -> None:
            logits = F.linear(h, weight)
            if mode == "torch":
                logits = torch.tanh(logits / cap) * cap
            elif mode == "kernel":
                logit_kernels.softcap_(logits, cap)
            logit_kernels.gumbel_argmax(logits, temperature, seeds, cap if mode == "sampler" else None)

        per_rows = {}
        for library in libraries:
            _blas(library)
            per_rows[f"{library}:head"] = seconds(lambda: F.linear(h, weight))
            for mode in SOFTCAP_MODES:
                per_rows[f"{library}:{mode}"] = seconds(partial(chain, mode))
            per_rows[f"{library}:layers"] = layers * sum(seconds(partial(F.linear, x, m)) for x, m in layer_inputs)
        _blas("default")
        per_rows["sampler_uncapped"] = seconds(lambda: logit_kernels.gumbel_argmax(F.linear(h, weight), temperature, seeds))
        # Each layer's post-attention norm, then the residual add + pre-feed-forward norm: two kernels or one.
        branch = torch.randn(rows, hidden, generator=g).to(device, dtype)
        per_rows["post_norm:separate"] = layers * seconds(lambda: fused.add_rms_norm(
            h, fused.rms_norm(branch, norm_w, 1e-6, True), [], norm_w, 1e-6, True))
        per_rows["post_norm:fused"] = layers * seconds(lambda: fused.add_rms_norm(
            h, branch, [], norm_w, 1e-6, True, delta_norm=(norm_w, 1e-6)))
        return per_rows

    totals: dict[str, float] = Counter()
    for rows, count in sorted(steps.items()):
        per_rows = at_rows(rows)
        for key, value in per_rows.items():
            totals[key] += value * count
        emit({"record": "logits_at", "rows": rows, "steps": count, "seconds_per_step": per_rows})
    head_bound = sum(steps.values()) * weight.numel() * weight.element_size() / speed
    emit({"record": "logits", "decode_steps": sum(steps.values()), "seconds": dict(totals),
          "head_weight_bound_seconds": head_bound,
          "vs_today": {k: v / totals["cublas:torch"] for k, v in totals.items() if k.startswith("cublas")
                       and "layers" not in k}})
    env = {}
    library = min(libraries, key=lambda lib: min(totals[f"{lib}:{m}"] for m in SOFTCAP_MODES) + totals[f"{lib}:layers"])
    if library == "cublaslt":
        env["TORCH_BLAS_PREFER_CUBLASLT"] = "1"
    env["STEERABLE_FINAL_SOFTCAP"] = min(SOFTCAP_MODES, key=lambda m: totals[f"{library}:{m}"])
    env["STEERABLE_FUSE_POST_NORM"] = "1" if totals["post_norm:fused"] < totals["post_norm:separate"] else "0"
    return env


def part_throughput(args, env: dict) -> None:
    """throughput.py per shape, today's defaults then ``env``: subprocesses (the engine reads the
    variables when it starts), each summarised here; the records go to throughput's own file."""
    base = {k: v for k, v in os.environ.items() if k not in provenance.TUNING_ENV}
    for shape in args.throughput_shapes.split(","):
        for label, extra in (("defaults", {}), ("candidate", env)):
            cmd = [sys.executable, "-m", "benchmarks", "throughput", "--shape", shape, "--skip-hf", "--repeats",
                   str(args.repeats), "--cache-dir", args.cache_dir, "--seed", str(args.seed)]
            if args.out:
                cmd += ["--out", args.out]
            if args.smoke:
                cmd.append("--smoke")
            proc = subprocess.run(cmd, env={**base, **extra}, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise SystemExit(f"throughput {shape} ({label}) failed:\n{proc.stderr[-3000:]}")
            records = {}
            for line in proc.stdout.splitlines():
                record = json.loads(line)
                records.setdefault(record["record"], record)
            emit({"record": "throughput", "shape": shape, "run": label, "env": extra,
                  "output_tok_s": records["steerable"]["output_tok_s"],
                  "seconds_all": records["steerable"]["seconds_all"],
                  "fraction_of_roofline": records["roofline"]["fraction_of_roofline"],
                  "measured_step_ms": records["roofline"]["measured_step_ms"]})


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.set_defaults(shape="gemma2-2b")
    p.add_argument("--parts", default="attention,logits,throughput")
    p.add_argument("--stride", type=int, default=16, help="attention: replay every stride-th decode step")
    p.add_argument("--candidates", default=None, help="attention: comma-separated names of CANDIDATES (default: all)")
    p.add_argument("--env", default=None, help='throughput: the candidate environment as JSON (default: the winners)')
    p.add_argument("--env-file", default=None, help="also write the winners' environment here, NAME=value lines")
    p.add_argument("--throughput-shapes", default="gemma2-2b,gemma3-270m")
    p.add_argument("--repeats", type=int, default=2, help="throughput: timed runs per engine")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"attention", "logits", "throughput"}:
        p.error("--parts takes attention, logits and throughput")
    common.setup("gemma2_decode", args, model=False)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke and parts & {"attention", "logits"}:
        raise SystemExit("gemma2_decode times GPU kernels: run it on a CUDA machine (or --smoke on a CPU)")
    device = "cuda" if cuda else "cpu"
    speed = common.copy_speed(torch.device(device))
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len)
    env: dict[str, str] = {}
    if "attention" in parts:
        env.update(part_attention(args, device, speed, w))
    if "logits" in parts:
        env.update(part_logits(args, device, speed, w))
    if args.env is not None:
        env = json.loads(args.env)
    emit({"record": "choice", "env": env})
    if args.env_file:
        with open(args.env_file, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in env.items())
    if "throughput" in parts:
        part_throughput(args, env)
