"""Feature dashboards of every feature in one pass, against sparse corpus capture and sae-dashboard.

Feature dashboards of every feature in one pass against sparse corpus capture (the top-k features
of every prompt row into shards) on the same engine, corpus and SAE, alternated in one process;
then sae-dashboard 0.8 (TransformerLens, the Neuronpedia pipeline's tool) on a slice of the corpus
and a subset of the features, its time scaled to every feature and the whole corpus, next to ours
on that same slice and subset.

The SAE is a random jumprelu of ``--d-sae`` features with unit decoder rows at ``post_mlp`` of
``--layer``; one threshold is calibrated on the corpus's first rows so ``--l0`` features fire per
token on average (a random SAE's activations would otherwise be dense, which no trained SAE is).
The corpus is ``--tokens`` tokens of random ids in texts of ``--text-len`` (Neuronpedia's 128).

    python -m benchmarks dashboards [--tokens 4000000] [--sae-dashboard-tokens 250000] [--chunk-rows N]

sae-dashboard reads the model through TransformerLens, whose loader accepts only its own table of
hub names: the local random checkpoint is passed through that lookup (a name for a path), which is
what lets it load offline; its SAE is our SAE's weights as a SAELens folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

from . import common
from .common import emit, timed


def random_sae(llm, texts: list[list[int]], d_sae: int, layer: int, l0: int, seed: int):
    """Unit decoder rows, encoder = their transpose, one threshold putting ``l0`` of ``d_sae``
    features above it on the corpus's first rows."""
    import steerable
    from steerable import SAE

    hidden = llm.llm_engine.model_config.hidden_size
    g = torch.Generator().manual_seed(seed)
    W_dec = torch.nn.functional.normalize(torch.randn(d_sae, hidden, generator=g), dim=1)
    rows = steerable.capture(llm, texts[:16], layers=[layer], select="all_prompt", dtype="float32").rows(layer)
    device = llm.llm_engine.device
    x = rows[torch.randperm(len(rows), generator=g)[:256]].to(device)
    pre = (x @ W_dec.T.to(device)).flatten()
    threshold = float(torch.topk(pre, l0 * len(x)).values[-1])
    return SAE(W_dec.T.contiguous(), torch.zeros(d_sae), W_dec, torch.zeros(hidden), architecture="jumprelu",
               threshold=torch.full((d_sae,), threshold), layer=layer, hook="post_mlp")


def corpus(tokens: int, text_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (max(1, tokens // text_len), text_len)).tolist()


def sparse_capture(llm, texts, args) -> float:
    from steerable.capture.corpus import capture_corpus

    root = tempfile.mkdtemp(prefix="steerable-dash-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        index, seconds = timed(lambda: capture_corpus(llm, texts, os.path.join(root, "run"), sae="sae",
                                                      top_k=args.top_k, select="all_prompt",
                                                      shard_size=args.shard_size, batch_size=args.batch_size))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = sum(e["rows"] for e in index["shards"])
    if rows != sum(map(len, texts)):
        raise SystemExit(f"corpus capture wrote {rows} rows for {sum(map(len, texts))} tokens")
    return seconds


def dashboards(llm, texts, args, features=None):
    from steerable import feature_dashboards

    return timed(lambda: feature_dashboards(llm, texts, "sae", features=features, batch_size=args.batch_size,
                                            chunk_rows=args.chunk_rows))


def sae_dashboard(path: str, sae, texts: list[list[int]], features: int, args) -> tuple[float, dict]:
    """sae-dashboard's SaeVisRunner as Neuronpedia's runner calls it (128 features per batch), in
    the model dtype; returns its seconds and its features' max activations."""
    import transformer_lens.loading_from_pretrained as loading
    from sae_dashboard.sae_vis_data import SaeVisConfig
    from sae_dashboard.sae_vis_runner import SaeVisRunner
    from sae_lens import SAE as LensSAE
    from sae_lens import HookedSAETransformer
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hook = f"blocks.{sae.layer}.hook_resid_post"
    folder = tempfile.mkdtemp(prefix="steerable-dash-sae-")
    try:
        from safetensors.torch import save_file
        save_file({"W_enc": sae.W_enc.float().contiguous(), "b_enc": sae.b_enc.float(), "W_dec": sae.W_dec.float(),
                   "b_dec": sae.b_dec.float(), "threshold": sae.threshold.float()},
                  os.path.join(folder, "sae_weights.safetensors"))
        with open(os.path.join(folder, "cfg.json"), "w") as f:
            json.dump({"architecture": "jumprelu", "d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32",
                       "device": "cpu", "apply_b_dec_to_input": False, "normalize_activations": "none",
                       "metadata": {"hook_name": hook}}, f)
        lens = LensSAE.load_from_disk(folder, device=device)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lens.cfg.metadata.hook_name = hook
    loading.get_official_model_name = lambda name: name  # a local checkpoint: no hub name to look up
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = HookedSAETransformer.from_pretrained_no_processing(path, hf_model=hf, device=device, dtype=dtype)
    del hf
    tokens = torch.tensor(texts, device=device)
    cfg = SaeVisConfig(hook_point=hook, features=list(range(features)), minibatch_size_features=128,
                       minibatch_size_tokens=args.sd_prompts_per_pass, device=device,
                       dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    data, seconds = timed(lambda: SaeVisRunner(cfg).run(encoder=lens, model=model, tokens=tokens))
    return seconds, {f: float(d.sequence_data.seq_group_data[0].title.split("= ")[-1])  # "TOP ACTIVATIONS<br>MAX = x"
                     for f, d in data.feature_data_dict.items()}


def workload_parser(description: str, default_tokens: str) -> argparse.ArgumentParser:
    """The common flags with this benchmark's workload (the SAE, the corpus, the engine's batch),
    shared with ``probes/dashboards_chunks``."""
    p = common.parser(description)
    p.set_defaults(gpu_memory_utilization=0.6)  # room beside the KV cache for the encoder's chunk and TransformerLens
    p.add_argument("--d-sae", type=int, default=None, help="SAE width (default 65536; --smoke 512)")
    p.add_argument("--layer", type=int, default=None, help="the SAE's layer (default 14; --smoke 1)")
    p.add_argument("--l0", type=int, default=64, help="features firing per token on average (default 64)")
    p.add_argument("--tokens", type=int, default=None, help=f"corpus tokens (default {default_tokens}; --smoke 3,072)")
    p.add_argument("--text-len", type=int, default=None, help="tokens per text (default 128; --smoke 24)")
    p.add_argument("--top-k", type=int, default=64, help="features per row of the sparse capture baseline")
    p.add_argument("--batch-size", type=int, default=None, help="texts in the engine at a time (default 256)")
    p.add_argument("--shard-size", type=int, default=None, help="texts per capture shard (default 2048)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = workload_parser(__doc__.splitlines()[0], default_tokens="4,000,000")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows encoded at once (default: the library's)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--sae-dashboard-tokens", type=int, default=None,
                   help="sae-dashboard's slice (default 250,000 tokens; --smoke 384; 0: skip it)")
    p.add_argument("--sae-dashboard-features", type=int, default=None, help="its features (default 1024; --smoke 64)")
    p.add_argument("--sd-prompts-per-pass", type=int, default=64, help="sae-dashboard's minibatch_size_tokens")
    args = p.parse_args(argv)
    path = common.setup("dashboards", args, {"d_sae": (65536, 512), "layer": (14, 1), "tokens": (4_000_000, 3072),
                                             "text_len": (128, 24), "batch_size": (256, 16), "shard_size": (2048, 16),
                                             "sae_dashboard_tokens": (250_000, 384),
                                             "sae_dashboard_features": (1024, 64)})
    llm = common.make_llm(args, path)
    texts = corpus(args.tokens, args.text_len, common.prompt_vocab(llm), args.seed)
    tokens = len(texts) * args.text_len
    sae, seconds = timed(lambda: random_sae(llm, texts, args.d_sae, args.layer, args.l0, args.seed))
    llm.register_sae("sae", sae)
    emit({"record": "sae", "d_sae": args.d_sae, "layer": args.layer, "l0_target": args.l0,
          "threshold": float(sae.threshold[0]), "build_seconds": seconds, "texts": len(texts), "tokens": tokens})
    head = texts[:max(1, len(texts) // 50)]
    sparse_capture(llm, head, args)  # warm-up: kernels, files, the encoder's shapes
    dashboards(llm, head, args)
    times: dict[str, list[float]] = {"sparse_capture": [], "dashboards": []}
    dash = None
    for _ in range(args.repeats):
        times["sparse_capture"].append(sparse_capture(llm, texts, args))
        dash, seconds = dashboards(llm, texts, args)
        times["dashboards"].append(seconds)
    for mode, values in times.items():
        t = common.median(values)
        emit({"record": "run", "mode": mode, "tokens": tokens, "seconds_all": values, "seconds": t,
              "prompt_tok_s": tokens / t})
    ratio = common.median(times["sparse_capture"]) / common.median(times["dashboards"])
    count = dash.state.dense.count
    emit({"record": "ratio", "dashboards_vs_sparse_capture": ratio, "target": 0.70,
          "mean_l0": float(count.double().sum()) / dash.tokens, "dead_features": len(dash.dead),
          "tokens_seen": dash.tokens})
    if dash.tokens != tokens:
        raise SystemExit(f"dashboards saw {dash.tokens} tokens of {tokens}")
    if args.sae_dashboard_tokens:
        features = min(args.sae_dashboard_features, args.d_sae)
        slice_texts = texts[:max(1, args.sae_dashboard_tokens // args.text_len)]
        ours, ours_s = dashboards(llm, slice_texts, args, features=list(range(features)))
        llm.shutdown()
        del llm
        common.free_cuda()
        with contextlib.redirect_stdout(sys.stderr):  # TransformerLens prints; stdout stays JSON lines
            theirs_s, peaks = sae_dashboard(path, sae, slice_texts, features, args)
        slice_tokens = len(slice_texts) * args.text_len
        scale = (args.d_sae / features) * (tokens / slice_tokens)
        agree = max(abs(peaks[f] - ours[f].max) / max(ours[f].max, 1e-6) for f in range(features) if ours[f].count)
        emit({"record": "sae_dashboard", "slice_tokens": slice_tokens, "features": features, "seconds": theirs_s,
              "ours_same_job_seconds": ours_s, "same_job_speedup": theirs_s / ours_s,
              "scaled_to_all_seconds": theirs_s * scale, "ours_all_seconds": common.median(times["dashboards"]),
              "all_features_speedup": theirs_s * scale / common.median(times["dashboards"]),
              "max_rel_diff_of_feature_max": agree})

