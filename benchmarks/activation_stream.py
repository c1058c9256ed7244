"""SAE training fed by ActivationStream against the same trainer reading a finished SAELens cache.

Issue 46: SAELens' ``SAETrainer`` trains a top-k SAE on one layer's activations (windows of
``--context-size`` tokens of a random-token corpus; Qwen3-0.6B shape in bf16 by default), (a) from
SAELens' own ``ActivationsStore`` over a SAELens activation cache of the same windows on local disk
(written first, float16, with ``datasets``; its pages still cached: the baseline's best case), (b)
from an ``ActivationStream`` capturing the windows on the same GPU while the trainer trains, in
one process. Same SAE initialisation, batch size, token count and shuffle-buffer size; the modes
alternate ``--repeats`` times and the ratio of median tokens/s is reported (target >= 0.70). Also
recorded: the stream drained without training (capture alone) and the trainer on batches already
on the device (training alone), which bound what (b) can reach.

    python -m benchmarks activation_stream [--tokens 2097152] [--d-sae 16384] [--k 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile

import numpy as np
import torch

from . import common
from .common import emit, timed


def documents(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Random-token documents (lengths uniform in [--min-len, --max-len]) holding the tokens both
    modes read, with room to spare."""
    needed = 2 * (args.tokens + args.shuffle_buffer + args.batch_size)
    w = common.workload(needed // ((args.min_len + args.max_len) // 2) + 8, args.seed, args.min_len, args.max_len, vocab)
    return w.prompts


def stream(llm, docs: list[list[int]], args: argparse.Namespace, device: str, shuffle: bool = True):
    from steerable import ActivationStream

    return ActivationStream(llm, docs, layers=[args.layer], context_size=args.context_size, batch_size=args.batch_size,
                            shuffle_buffer=args.shuffle_buffer if shuffle else 0, seed=args.seed, device=device,
                            dtype="float32", bos_token_id=args.bos_token_id)


def write_cache(llm, docs: list[list[int]], args: argparse.Namespace, root: str, device: str) -> str:
    """The SAELens activation cache of the windows the stream reads (in window order): a ``datasets``
    directory with the layer's column (``Array2D((context, d), float16)``) and ``token_ids``."""
    import datasets

    from steerable.capture.windows import token_windows

    s = stream(llm, docs, args, device, shuffle=False)
    name, n = s.hook_names[0], args.context_size
    windows = token_windows(docs, n, args.bos_token_id)
    total = (args.tokens + args.shuffle_buffer) // n + args.batch_size // n
    features = datasets.Features({name: datasets.Array2D((n, s.d_in), "float16"),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=n)})
    out = os.path.join(root, "cache")

    def build():
        parts, written = [], 0
        batches = iter(s)
        try:
            for batch in batches:
                acts = batch.to(torch.float16).cpu().numpy().reshape(-1, n, s.d_in)[:total - written]
                ids = np.asarray(list(itertools.islice(windows, len(acts))), np.int32)
                parts.append(datasets.Dataset.from_dict({name: acts, "token_ids": ids}, features=features))
                written += len(acts)
                if written == total:
                    break
        finally:
            batches.close()  # the stream's engine thread stops here
        return datasets.concatenate_datasets(parts)

    ds, seconds = timed(build)
    ds.save_to_disk(out, max_shard_size="2GB")
    emit({"record": "cache_write", "windows": len(ds), "seconds": seconds, "dir": out,
          "bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))})
    return out


def trainer(args: argparse.Namespace, d_in: int, provider, device: str, tokens: int):
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    torch.manual_seed(args.seed)  # the same initial SAE in every run
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=args.d_sae, k=args.k, dtype="float32", device=device))
    cfg = SAETrainerConfig(total_training_samples=tokens, train_batch_size_samples=args.batch_size, device=device,
                           lr=3e-4, lr_end=3e-4, n_batches_for_norm_estimate=1)
    return SAETrainer(cfg, sae, provider)


def cache_store(path: str, args: argparse.Namespace, d_in: int, name: str, device: str, tokens: int):
    """SAELens' reader of a cache, shuffled through a buffer of the same size as the stream's."""
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore(model=None, dataset=None, streaming=False, hook_name=name, hook_head_index=None,
                            context_size=args.context_size, d_in=d_in,
                            n_batches_in_buffer=max(1, args.shuffle_buffer // args.context_size),
                            total_training_tokens=tokens, store_batch_size_prompts=args.store_batch_prompts,
                            train_batch_size_tokens=args.batch_size, prepend_bos=False, normalize_activations="none",
                            device=torch.device(device), dtype="float32", cached_activations_path=path)


def train(args, d_in: int, provider, device: str, tokens: int) -> float:
    """Seconds for ``tokens`` training samples (the provider's buffer fill included, as in a run)."""
    t = trainer(args, d_in, provider, device, tokens)
    try:
        _, seconds = timed(t.fit)
    finally:
        if hasattr(provider, "close"):  # a stream's generator: its engine thread stops now, not at collection
            provider.close()
    if not torch.isfinite(t.sae.W_dec).all():
        raise SystemExit("the SAE's weights are not finite")
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None, help="training samples per run (default 2M; --smoke 4096)")
    p.add_argument("--layer", type=int, default=None, help="default 14 (--smoke 1)")
    p.add_argument("--context-size", type=int, default=None, help="default 128 (--smoke 16)")
    p.add_argument("--batch-size", type=int, default=None, help="training batch in tokens (default 4096; --smoke 128)")
    p.add_argument("--shuffle-buffer", type=int, default=None, help="rows (default 65536; --smoke 512)")
    p.add_argument("--store-batch-prompts", type=int, default=32, help="windows per cache read (SAELens' default)")
    p.add_argument("--d-sae", type=int, default=None, help="default 16384 (--smoke 256)")
    p.add_argument("--k", type=int, default=None, help="default 32 (--smoke 8)")
    p.add_argument("--bos-token-id", type=int, default=None, help="default: the model config's")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tmp-dir", default=None, help="where the cache goes (default: the temp dir, local disk)")
    args = p.parse_args(argv)
    if args.gpu_memory_utilization == 0.9:
        args.gpu_memory_utilization = 0.5  # the trainer needs the rest of the GPU
    path = common.setup("activation_stream", args, {
        "tokens": (2 * 2**20, 4096), "layer": (14, 1), "context_size": (128, 16), "batch_size": (4096, 128),
        "shuffle_buffer": (65536, 512), "d_sae": (16384, 256), "k": (32, 8)})
    if args.bos_token_id is None:
        import json
        with open(os.path.join(path, "config.json")) as f:
            args.bos_token_id = json.load(f).get("bos_token_id")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = common.make_llm(args, path, enforce_eager=True)  # no CUDA graph is captured while the trainer runs
    docs = documents(args, common.prompt_vocab(llm))
    d_in = llm.engine.model_config.hidden_size
    root = tempfile.mkdtemp(prefix="steerable-activation-stream-", dir=args.tmp_dir)
    try:
        cache = write_cache(llm, docs, args, root, device)
        name = f"blocks.{args.layer}.hook_resid_post"
        warm = 4 * args.batch_size
        train(args, d_in, cache_store(cache, args, d_in, name, device, warm), device, warm)  # first kernels, cuBLAS
        train(args, d_in, iter(stream(llm, docs, args, device)), device, warm)
        times = {"cache": [], "stream": []}
        for r in range(args.repeats):
            for mode in times:
                provider = cache_store(cache, args, d_in, name, device, args.tokens) if mode == "cache" else \
                    iter(stream(llm, docs, args, device))
                seconds = train(args, d_in, provider, device, args.tokens)
                times[mode].append(seconds)
                emit({"record": "run", "mode": mode, "repeat": r, "tokens": args.tokens, "seconds": seconds,
                      "tok_s": args.tokens / seconds})
        bounds(llm, docs, args, d_in, device)
        rate = {mode: args.tokens / common.median(t) for mode, t in times.items()}
        emit({"record": "ratio", "cache_tok_s": rate["cache"], "stream_tok_s": rate["stream"],
              "stream_over_cache": rate["stream"] / rate["cache"], "target": 0.70,
              "meets": rate["stream"] / rate["cache"] >= 0.70, "d_sae": args.d_sae, "k": args.k,
              "batch_size": args.batch_size, "shuffle_buffer": args.shuffle_buffer, "device": device})
    finally:
        shutil.rmtree(root, ignore_errors=True)


def bounds(llm, docs, args, d_in: int, device: str) -> None:
    """What each half does alone: the stream drained without training, the trainer on batches
    already on the device."""
    batches = args.tokens // args.batch_size

    def drain():
        batch_iter = iter(stream(llm, docs, args, device))
        try:
            return sum(1 for _ in itertools.islice(batch_iter, batches))
        finally:
            batch_iter.close()

    _, seconds = timed(drain)
    emit({"record": "capture_only", "tokens": batches * args.batch_size, "seconds": seconds,
          "tok_s": batches * args.batch_size / seconds})
    resident = [torch.randn(args.batch_size, d_in, device=device) for _ in range(8)]
    seconds = train(args, d_in, itertools.cycle(resident), device, args.tokens)
    emit({"record": "train_only", "tokens": args.tokens, "seconds": seconds, "tok_s": args.tokens / seconds})


if __name__ == "__main__":
    main()
