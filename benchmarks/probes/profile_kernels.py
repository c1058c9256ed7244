"""Where does a workload's GPU time go, kernel by kernel?

The torch profiler over a workload, CUDA-graph replays included.

Three phases, each profiled after a warm-up of the same shape:
- ``workload``: the throughput workload (``throughput.py``'s requests), the whole run; with
  ``--steering MODE`` steered as ``steering_cost.py``'s mode of that name (wall time beside kernel
  time shows what the host adds);
- ``decode``: ``--batch`` requests of 16 prompt tokens decoding ``--steps`` tokens each (the
  one prefill step of 16 x batch tokens is included; per-step figures divide by ``--steps``), for
  each ``--steering`` mode in turn;
- ``prefill``: one prompt of ``--prefill-tokens`` tokens, one output token (one prefill chunk
  when it is no longer than ``--max-num-batched-tokens``);
- ``chat``: ``chat.py``'s workload (chats sharing one system prompt), once with
  prefix caching alone (``cache_on``) and once with shared-prefix attention (``shared``).
Kernels are grouped into categories by name (MoE GEMM, MoE align, attention, dense GEMM, norms,
...) and the largest kernels listed, as JSON lines.

    python -m benchmarks profile_kernels --shape qwen3-30b-a3b --phase decode --batch 256
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from steerable import SamplingParams

from .. import chat, common, sae_cost, steering_cost
from ..common import emit

CATEGORIES = [  # first match wins
    ("moe_gemm", r"_moe_gemm_kernel|_moe_gemv_"),
    ("moe_align", r"_moe_(count|place)_kernel|cumsum|searchsorted|scatter|bincount"),
    ("attention", r"attention|_attn|split_kv|paged|_shared_pass"),
    ("norm_steering", r"rms_norm|_norm_kernel|_steer"),
    ("rope_kv_store", r"rope|store_kv"),
    ("gated_act", r"_gated_mul"),
    ("router_topk", r"topk|softmax|sort"),
    ("dense_gemm", r"gemm|gemv|sm90_xmma|cutlass|nvjet|_gemv"),
    ("sampler", r"sample|_sampler|argmax"),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile(fn) -> tuple[dict[str, float], float]:
    """(kernel name -> total device ms, wall seconds) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    common.sync()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        _, seconds = common.timed(fn)
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / 1000.0
    return dict(totals), seconds


def report(phase: str, totals: dict[str, float], seconds: float, divide: int, top: int) -> None:
    by_category: dict[str, float] = defaultdict(float)
    for name, ms in totals.items():
        by_category[category(name)] += ms
    kernel_ms = sum(totals.values())
    emit({"record": "profile", "phase": phase, "wall_s": seconds, "kernel_ms": kernel_ms, "divided_by": divide,
          "kernel_ms_per_unit": kernel_ms / divide,
          "categories_ms_per_unit": {k: v / divide for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])}})
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        emit({"record": "kernel", "phase": phase, "name": name[:160], "category": category(name),
              "ms_per_unit": ms / divide, "share": ms / kernel_ms})


def sae_capture(llm, requests: int, args) -> list[dict]:
    """Register sae_cost.py's random SAE (65,536 features at layer 14; --smoke: 256 at layer 1) and
    return per-request extras capturing the top 32 features of every token."""
    from steerable import CaptureSpec

    d_sae, layer = (256, 1) if args.smoke else (65536, 14)
    llm.register_sae("sae", sae_cost.random_sae(llm.engine.model_config.hidden_size, d_sae, layer, args.seed))
    return [{"capture": CaptureSpec(stream="sae_features", saes=["sae"], top_k=32, select="all")}] * requests


def profile_workload(llm, args, mode: str) -> None:
    """One warm-up and one profiled run of the throughput workload steered as ``mode``."""
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    global_specs, extras = steering_cost.mode_steering(llm, w, args)
    llm.clear_steering_vectors()
    if mode in global_specs:
        llm.set_steering_vectors(global_specs[mode])
    extra = extras.get(mode)
    if args.sae_capture:
        extra = sae_capture(llm, len(w), args)
    common.warm_up(llm, w, args, f"warm-{mode}", extra=extra)
    before = llm.llm_engine.stats()
    totals, seconds = profile(lambda: llm.generate(w.prompts, common.sampling_params(w, f"profiled-{mode}", extra),
                                                   use_tqdm=False))
    after = llm.llm_engine.stats()
    report(f"workload_{mode}", totals, seconds, 1, args.top)
    emit({"record": "engine", "steering": mode, "sae_capture": args.sae_capture,
          **{k: after[k] - before[k] for k in ("num_steps", "graph_captures", "graph_replays")}})


def profile_decode(llm, args, prompts: list[list[int]], mode: str) -> None:
    """``--steps`` decode steps of the batch steered as ``mode`` (every request its own config for a
    per-request mode), after one unprofiled pass of the same shape."""
    w = common.Workload(prompts, [len(p) for p in prompts], [args.steps + 1] * len(prompts))
    global_specs, extras = steering_cost.mode_steering(llm, w, args)
    llm.clear_steering_vectors()
    if mode in global_specs:
        llm.set_steering_vectors(global_specs[mode])
    extra = extras.get(mode)
    llm.generate(prompts, common.sampling_params(w, f"warm-{mode}", extra, seed=1), use_tqdm=False)
    params = common.sampling_params(w, f"profiled-{mode}", extra, seed=1)
    totals, seconds = profile(lambda: llm.generate(prompts, params, use_tqdm=False))
    report("decode" if mode == "none" else f"decode_{mode}", totals, seconds, args.steps, args.top)
    llm.clear_steering_vectors()


def profile_chat(llm, args) -> None:
    """The chat workload with prefix caching alone, then with shared-prefix attention: one warm-up and
    one profiled run each, the step counts beside the kernel times."""
    engine = llm.llm_engine
    detector = engine.builder.shared_prefix
    w = chat.chat_workload(args, common.prompt_vocab(llm))
    for mode in ("cache_on", "shared"):
        engine.builder.shared_prefix = detector if mode == "shared" else None
        common.warm_up(llm, w, args, f"warm-{mode}")
        before = engine.stats()
        totals, seconds = profile(lambda: llm.generate(w.prompts, common.sampling_params(w, mode), use_tqdm=False))
        after = engine.stats()
        report(f"chat_{mode}", totals, seconds, 1, args.top)
        emit({"record": "engine", "mode": mode, **{k: after[k] - before[k] for k in (
            "num_steps", "shared_prefix_steps", "graph_captures", "graph_replays", "prefix_cache_hit_tokens")}})
    engine.builder.shared_prefix = detector


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--phase", default="decode", choices=["workload", "decode", "prefill", "chat"])
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--prefill-tokens", type=int, default=None)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steering", default="none",
                   help="workload and decode phases: comma-separated steering_cost.py modes, each profiled in turn")
    p.add_argument("--sae-capture", action="store_true",
                   help="workload phase: capture sae_cost.py's top-32 features of every token (its random SAE)")
    p.add_argument("--system-len", type=int, default=None, help="chat phase: tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    steering_cost.add_arguments(p)
    args = p.parse_args(argv)
    if set(args.steering.split(",")) - set(steering_cost.MODES):
        p.error(f"--steering takes modes of {list(steering_cost.MODES)}")
    if args.sae_capture and args.steering != "none":
        p.error("--sae-capture profiles an unsteered workload: leave --steering at none")
    defaults = {"batch": (256, 2), "steps": (32, 3), "prefill_tokens": (8192, 12), "system_len": (1200, 48),
                "user_len": ((20, 200), (2, 12)), "output_len": ((20, 400), (2, 10))}
    if args.phase == "chat":
        defaults["num_requests"] = (512, 12)  # chat.py's workload
    path = common.setup("profile_kernels", args, defaults)
    llm = common.make_llm(args, path)
    vocab = common.prompt_vocab(llm)
    g = torch.Generator().manual_seed(args.seed)
    if args.phase == "chat":
        profile_chat(llm, args)
        llm.shutdown()
        return
    if args.phase == "workload":
        for mode in args.steering.split(","):
            profile_workload(llm, args, mode)
        llm.shutdown()
        return
    if args.phase == "decode":
        prompts = torch.randint(0, vocab, (args.batch, 16), generator=g).tolist()
        for mode in args.steering.split(","):
            profile_decode(llm, args, prompts, mode)
        llm.shutdown()
        return
    else:
        prompt = torch.randint(0, vocab, (args.prefill_tokens,), generator=g).tolist()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, cache_salt="warm"), use_tqdm=False)
        run = lambda: llm.generate([prompt], params, use_tqdm=False)  # noqa: E731
        divide = 1
    totals, seconds = profile(run)
    report(args.phase, totals, seconds, divide, args.top)
    llm.shutdown()

