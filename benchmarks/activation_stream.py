"""Top-k SAE training fed by ActivationStream against the same trainer reading a finished SAELens cache.

Issue 46: a top-k SAE's training loop (``benchmarks/topk_trainer.py``: SAELens' ``TopKTrainingSAE``
under its ``SAETrainer``, the same init, math, Adam and bookkeeping in plain torch, checked step
for step against SAELens; ``--trainer saelens`` runs SAELens' own where it is installed) trains on
one layer's activations (windows of ``--context-size`` tokens of a random-token corpus; Qwen3-0.6B
shape in bf16 by default, float32 rows), in one process on one device:

- ``cache``: from a SAELens activation cache of the windows on local disk, written first by
  ``capture_corpus(..., format="saelens")`` (float16 by default; its pages still cached: the
  baseline's best case) and read as a trainer reads it: the data files memory-mapped with pyarrow,
  ``--store-batch-prompts`` windows at a time, pinned, copied to the device asynchronously and
  shuffled there through the stream's own mixing buffer of the same size and seed;
- ``stream``: from an ``ActivationStream`` capturing the same windows on the same device while
  the trainer trains.

Same SAE initialisation, batch size, token count and shuffle-buffer size; the modes alternate
``--repeats`` times and the ratio of median tokens/s is reported (target >= 0.70). Also recorded:
the stream drained without training (``capture_only``) and the trainer on batches already on the
device (``train_only``), which bound what the stream can reach. Imports neither sae_lens nor
datasets unless ``--trainer saelens``.

    python -m benchmarks activation_stream [--tokens 2097152] [--d-sae 16384] [--k 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import torch

from . import common
from .common import emit, timed
from .topk_trainer import TRAINERS


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


def write_cache(llm, docs: list[list[int]], args: argparse.Namespace, root: str) -> str:
    """The SAELens cache of the stream's first windows (as many as a run reads, the shuffle
    buffer's tail and a batch to spare), written by the engine's own writer."""
    from steerable import capture_corpus
    from steerable.capture.windows import token_windows

    n = args.context_size
    count = -(-(args.tokens + args.shuffle_buffer + args.batch_size) // n)
    windows = np.asarray(list(itertools.islice(token_windows(docs, n, args.bos_token_id), count)), dtype=np.int32)
    if len(windows) < count:
        raise SystemExit(f"the corpus fills {len(windows)} windows of {n}, the cache needs {count}")
    out = os.path.join(root, "cache")
    _, seconds = timed(lambda: capture_corpus(llm, windows, out, format="saelens", context_size=n, layers=[args.layer],
                                              dtype=args.store_dtype, batch_size=args.max_num_seqs))
    emit({"record": "cache_write", "windows": len(windows), "tokens": windows.size, "seconds": seconds,
          "tok_s": windows.size / seconds, "store_dtype": args.store_dtype, "dir": out,
          "bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))})
    return out


def cache_chunks(path: str, column: str, windows_per_read: int, d_in: int) -> Iterator[torch.Tensor]:
    """The cache's rows in window order, ``windows_per_read`` windows at a time, as host tensors
    of the stored dtype: views of the memory-mapped data files (listed in ``state.json``), no copy."""
    import pyarrow as pa

    with open(os.path.join(path, "state.json")) as f:
        files = [entry["filename"] for entry in json.load(f)["_data_files"]]
    for name in files:
        with pa.memory_map(os.path.join(path, name)) as source:
            for batch in pa.ipc.open_stream(source):
                values = batch.column(column)
                if isinstance(values, pa.ExtensionArray):  # datasets, once imported, registers its Array2D type
                    values = values.storage
                for start in range(0, batch.num_rows, windows_per_read):
                    flat = values.slice(start, windows_per_read).flatten().flatten().to_numpy(zero_copy_only=True)
                    with warnings.catch_warnings():  # the mapping is read-only, and nothing writes to it
                        warnings.simplefilter("ignore", UserWarning)
                        yield torch.from_numpy(flat).view(-1, d_in)


def cache_batches(path: str, args: argparse.Namespace, d_in: int, device: str) -> Iterator[torch.Tensor]:
    """Shuffled batches of the cache on ``device``: its chunks go through ``ActivationStream``'s
    own mixing buffer (same size, same seed), so the two modes differ only in where rows come from."""
    from steerable.entrypoints.activation_stream import _MixingBuffer

    chunks = cache_chunks(path, f"blocks.{args.layer}.hook_resid_post", args.store_batch_prompts, d_in)
    if device == "cuda":  # pinned, as a DataLoader with pin_memory=True hands them: the copy is asynchronous
        chunks = (chunk.pin_memory() for chunk in chunks)
    feed = SimpleNamespace(next_chunk=lambda: next(chunks, None))
    like = SimpleNamespace(device=torch.device(device), shuffle_buffer=args.shuffle_buffer, batch_size=args.batch_size,
                           drop_last=False)
    generator = torch.Generator().manual_seed(args.seed)
    return _MixingBuffer(like, generator).batches(feed)


def check(llm, docs: list[list[int]], cache: str, args: argparse.Namespace, d_in: int, device: str) -> None:
    """Both modes read the same activations: the cache's first rows are the unshuffled stream's
    first rows in the stored dtype (bf16 GEMMs may tile the two batches otherwise: a small tolerance)."""
    cached = next(cache_chunks(cache, f"blocks.{args.layer}.hook_resid_post", args.store_batch_prompts, d_in)).float()
    batch_iter = iter(stream(llm, docs, args, device, shuffle=False))
    try:
        live = torch.cat(list(itertools.islice(batch_iter, -(-len(cached) // args.batch_size))))[:len(cached)]
    finally:
        batch_iter.close()
    live = live.to(getattr(torch, args.store_dtype)).float().cpu()
    diff, scale = (cached - live).abs().max().item(), live.abs().max().item()
    emit({"record": "check", "rows": len(cached), "max_abs_diff": diff, "max_abs": scale, "ok": diff <= 2e-2 * scale})
    if diff > 2e-2 * scale:
        raise SystemExit("the cache does not hold the stream's rows")


def train(args: argparse.Namespace, d_in: int, provider: Iterator[torch.Tensor], device: str, tokens: int) -> float:
    """Seconds for ``tokens`` training samples (the provider's buffer fill included, as in a run)."""
    trainer = TRAINERS[args.trainer](d_in, args.d_sae, args.k, args.batch_size, device, args.seed)
    try:
        _, seconds = timed(lambda: trainer.fit(provider, tokens))
    finally:
        if hasattr(provider, "close"):  # a generator: a stream's engine thread stops now, not at collection
            provider.close()
    if not torch.isfinite(trainer.W_dec).all():
        raise SystemExit("the SAE's weights are not finite")
    return seconds


def bounds(llm, docs: list[list[int]], args: argparse.Namespace, d_in: int, device: str) -> None:
    """What each half does alone: the stream drained without training, the trainer on batches
    already on the device."""
    batches = args.tokens // args.batch_size

    def drain() -> int:
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


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None, help="training samples per run (default 2M; --smoke 4096)")
    p.add_argument("--layer", type=int, default=None, help="default 14 (--smoke 1)")
    p.add_argument("--context-size", type=int, default=None, help="default 128 (--smoke 16)")
    p.add_argument("--batch-size", type=int, default=None, help="training batch in tokens (default 4096; --smoke 128)")
    p.add_argument("--shuffle-buffer", type=int, default=None, help="rows (default 65536; --smoke 512)")
    p.add_argument("--store-batch-prompts", type=int, default=32,
                   help="windows per cache read (SAELens' store_batch_size_prompts default)")
    p.add_argument("--store-dtype", default="float16", choices=["float16", "float32"], help="the cache's dtype")
    p.add_argument("--d-sae", type=int, default=None, help="default 16384 (--smoke 256)")
    p.add_argument("--k", type=int, default=None, help="default 32 (--smoke 8)")
    p.add_argument("--trainer", default="torch", choices=sorted(TRAINERS),
                   help="torch: SAELens' top-k training step in plain torch (default); saelens: SAELens' own")
    p.add_argument("--bos-token-id", type=int, default=None, help="default: the model config's")
    p.add_argument("--repeats", type=int, default=None, help="alternating runs of each mode (default 2; --smoke 1)")
    p.add_argument("--tmp-dir", default=None, help="where the cache goes (default: the temp dir, local disk)")
    args = p.parse_args(argv)
    if args.gpu_memory_utilization == 0.9:
        args.gpu_memory_utilization = 0.5  # the trainer needs the rest of the GPU
    path = common.setup("activation_stream", args, {
        "tokens": (2 * 2**20, 4096), "layer": (14, 1), "context_size": (128, 16), "batch_size": (4096, 128),
        "shuffle_buffer": (65536, 512), "d_sae": (16384, 256), "k": (32, 8), "repeats": (2, 1)})
    if args.bos_token_id is None:
        with open(os.path.join(path, "config.json")) as f:
            args.bos_token_id = json.load(f).get("bos_token_id")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = common.make_llm(args, path, enforce_eager=True)  # no CUDA graph is captured while the trainer runs
    docs = documents(args, common.prompt_vocab(llm))
    d_in = llm.engine.model_config.hidden_size
    root = tempfile.mkdtemp(prefix="steerable-activation-stream-", dir=args.tmp_dir)
    try:
        cache = write_cache(llm, docs, args, root)
        check(llm, docs, cache, args, d_in, device)
        providers = {"cache": lambda: cache_batches(cache, args, d_in, device),
                     "stream": lambda: iter(stream(llm, docs, args, device))}
        for make in providers.values():  # first kernels, cuBLAS handles, the allocator's pools
            train(args, d_in, make(), device, 4 * args.batch_size)
        times: dict[str, list[float]] = {"cache": [], "stream": []}
        for r in range(args.repeats):
            for mode, make in providers.items():
                seconds = train(args, d_in, make(), device, args.tokens)
                times[mode].append(seconds)
                emit({"record": "run", "mode": mode, "repeat": r, "tokens": args.tokens, "seconds": seconds,
                      "tok_s": args.tokens / seconds})
        bounds(llm, docs, args, d_in, device)
        rate = {mode: args.tokens / common.median(t) for mode, t in times.items()}
        emit({"record": "ratio", "cache_tok_s": rate["cache"], "stream_tok_s": rate["stream"],
              "stream_over_cache": rate["stream"] / rate["cache"], "target": 0.70,
              "meets": rate["stream"] / rate["cache"] >= 0.70, "trainer": args.trainer, "d_sae": args.d_sae,
              "k": args.k, "batch_size": args.batch_size, "shuffle_buffer": args.shuffle_buffer,
              "store_dtype": args.store_dtype, "device": device})
    finally:
        shutil.rmtree(root, ignore_errors=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
