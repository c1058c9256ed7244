"""Cost of SAE and transcoder feature capture and feature steering, and the speed of sparse corpus capture.

Cost of the SAE plane on one engine and one workload, each mode against no SAE in the same
process: (a) no SAE, (b) capture of the top-k features of every token (prompt and generated) of a
random jumprelu SAE at one layer, (c) N distinct per-request configs of feature adds and feature
clamps of that SAE, (e) capture of the top-k features of every token of a random jumprelu
transcoder at that layer (it reads mlp_in), (f) N distinct configs of that transcoder's feature
adds (at mlp_out) and feature clamps (read at mlp_in, written at mlp_out). Cost = (t_x / t_a - 1) *
100, from median times. Then (d) sparse corpus capture (``capture_corpus(sae=...)``, the top-k
features of every prompt row into safetensors shards in RAM) over the same prompts: prompt
tokens/s, median of the repeats, rows checked. ``--modes`` runs a subset (``none`` always runs).

    python -m benchmarks sae_cost [--d-sae 65536] [--transcoder-width 16384] [--layer 14] [--repeats 3]
        [--modes none,transcoder_capture_top_k_every_token] [--no-corpus]
"""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial

import numpy as np
import torch

from . import common
from .common import emit, timed

MODES = ("none", "capture_top_k_every_token", "feature_steering_distinct", "transcoder_capture_top_k_every_token",
         "transcoder_steering_distinct")


def random_sae(hidden: int, d_sae: int, layer: int, seed: int):
    """A jumprelu SAE with unit decoder rows; thresholds and scales give a few dozen active features."""
    from steerable import SAE

    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, hidden, generator=g), dim=1)
    return SAE(W_dec.T.contiguous(), torch.zeros(d_sae), W_dec, torch.zeros(hidden), architecture="jumprelu",
               threshold=torch.full((d_sae,), 0.05), layer=layer, hook="post_mlp")


def random_transcoder(hidden: int, width: int, layer: int, seed: int):
    """A jumprelu transcoder at ``layer`` (reading mlp_in, writing mlp_out), made as ``random_sae``."""
    from steerable import Transcoder

    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(width, hidden, generator=g), dim=1)
    return Transcoder(W_dec.T.contiguous(), torch.zeros(width), W_dec, torch.zeros(hidden), architecture="jumprelu",
                      threshold=torch.full((width,), 0.05), layer=layer)


def feature_config(i: int, d_sae: int, adds: int, clamps: int, rng: np.random.Generator, name: str = "sae"):
    """Request i's own config: ``adds`` feature adds and ``clamps`` feature clamps, distinct indices."""
    from steerable import Feature, FeatureClamp, SteeringSpec

    index = rng.choice(d_sae, adds + clamps, replace=False).tolist()
    return SteeringSpec(features=[Feature(name, j, scale=0.5 + 0.01 * i) for j in index[:adds]] +
                                 [FeatureClamp(name, j, value=0.0) for j in index[adds:]])


def corpus_rate(llm, w: common.Workload, args) -> None:
    """(d): every prompt row's top-k features to shards; a wrong row count exits non-zero."""
    from steerable.capture.corpus import capture_corpus

    root = tempfile.mkdtemp(prefix="steerable-sae-corpus-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    kwargs = dict(sae="sae", top_k=args.top_k, select="all_prompt", shard_size=args.shard_size,
                  batch_size=args.shard_size)
    try:
        capture_corpus(llm, w.head(min(len(w), args.shard_size)).prompts, os.path.join(root, "warmup"), **kwargs)
        times, rows = [], 0
        for r in range(args.repeats):
            index, seconds = timed(lambda: capture_corpus(llm, w.prompts, os.path.join(root, f"run{r}"), **kwargs))
            times.append(seconds)
            rows = sum(e["rows"] for e in index["shards"])
            shutil.rmtree(os.path.join(root, f"run{r}"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = common.median(times)
    emit({"record": "run", "mode": "corpus_sparse", "requests": len(w), "repeats": args.repeats, "seconds_all": times,
          "rows": rows, "prompt_tokens": sum(w.input_lens), "prompt_tok_s": sum(w.input_lens) / t})
    if rows != sum(w.input_lens):
        raise SystemExit(f"corpus capture wrote {rows} rows for {sum(w.input_lens)} prompt tokens")


def main(argv: list[str] | None = None) -> None:
    from steerable import CaptureSpec

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1, help="alternate the modes this many times; report medians")
    p.add_argument("--d-sae", type=int, default=None, help="SAE width (default 65536; --smoke 256)")
    p.add_argument("--transcoder-width", type=int, default=None, help="transcoder width (default 16384; --smoke 128)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--no-corpus", action="store_true", help="skip (d), the sparse corpus capture")
    p.add_argument("--layer", type=int, default=None, help="the SAE's layer (default 14; --smoke 1)")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--feature-adds", type=int, default=8)
    p.add_argument("--feature-clamps", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=None, help="corpus examples per shard (default 64; --smoke 4)")
    args = p.parse_args(argv)
    modes = ["none"] + [m for m in MODES[1:] if m in args.modes.split(",")]
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; expected a subset of {list(MODES)}")
    path = common.setup("sae_cost", args, {"d_sae": (65536, 256), "layer": (14, 1), "shard_size": (64, 4),
                                           "transcoder_width": (16384, 128)})
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    cfg = llm.engine.model_config
    sae, seconds = timed(lambda: random_sae(cfg.hidden_size, args.d_sae, args.layer, args.seed))
    _, register_s = timed(lambda: llm.register_sae("sae", sae))
    emit({"record": "sae", "d_sae": args.d_sae, "layer": args.layer, "build_seconds": seconds,
          "register_seconds": register_s})
    transcoder, seconds = timed(lambda: random_transcoder(cfg.hidden_size, args.transcoder_width, args.layer,
                                                          args.seed + 2))
    _, register_s = timed(lambda: llm.register_sae("tc", transcoder))
    emit({"record": "transcoder", "d_transcoder": args.transcoder_width, "layer": args.layer, "hook": transcoder.hook,
          "build_seconds": seconds, "register_seconds": register_s})
    rng = np.random.default_rng(args.seed + 1)

    def capture(name: str) -> list[dict]:
        return [{"capture": CaptureSpec(stream="sae_features", saes=[name], top_k=args.top_k, select="all")}] * len(w)

    def steering(name: str, width: int) -> list[dict]:
        return [{"steering_vectors": feature_config(i, width, args.feature_adds, args.feature_clamps, rng, name)}
                for i in range(len(w))]

    extras = {"capture_top_k_every_token": capture("sae"),
              "feature_steering_distinct": steering("sae", args.d_sae),
              "transcoder_capture_top_k_every_token": capture("tc"),
              "transcoder_steering_distinct": steering("tc", args.transcoder_width)}
    for mode in modes:  # the SAE paths (tables, kernels, graphs) get warmed too
        common.warm_up(llm, w, args, f"warmup-{mode}", extras.get(mode))
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        for mode in modes:
            params = common.sampling_params(w, f"{mode}-{r}", extras.get(mode))
            outs, seconds = timed(partial(llm.generate, w.prompts, params, use_tqdm=False))
            times[mode].append(seconds)
            tokens[mode] = common.generated_tokens(outs)
    base = common.median(times["none"])
    for mode in modes:
        t = common.median(times[mode])
        emit({"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats, "seconds_all": times[mode],
              **common.throughput(t, sum(w.input_lens), tokens[mode]), "cost_pct": (t / base - 1) * 100})
    if not args.no_corpus:
        corpus_rate(llm, w, args)
    status = llm.get_steering_status()
    ok = status.get("rows_in_use") == 0 and status.get("configs_in_use", 0) == 0
    emit({"record": "steering_status", "ok": ok, **status})
    llm.unregister_sae("sae")  # refused if anything still used it
    llm.unregister_sae("tc")
    if not ok:
        raise SystemExit("steering rows still in use after every request finished")

