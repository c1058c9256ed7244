"""Per-shard overhead of corpus capture (scheduling, write, commit), of a shard's capture time.

Issue 46: under 2 % of a shard's capture time, on CPU: what a shard costs beyond computing its rows,
in the SAELens format, in one engine and on replicas.

A shard's cost has three parts besides the engine's steps: scheduling (setting the shard up and
handing it to the engine's loop; with replicas also the wait for the driver's answer), writing its
Arrow file and committing it (rename, index). ``capture_corpus`` reports each (``stats``): the
engine-thread parts directly, the write and commit from the writer thread, which runs beside the
engine. The fraction reported counts all of them against the engine's step time, as if none
overlapped (an upper bound). The same windows are also captured as one single shard and as many
(``--shard-windows``), alternating ``--repeats`` times: the extra wall time per extra shard is the
end-to-end check.

    python -m benchmarks corpus_shards [--model smollm2] [--windows 128] [--shard-windows 16]
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

import numpy as np

from . import common
from .common import emit, timed


def overhead(stats: dict, shards: int) -> dict:
    """Seconds per shard of each part and their sum against the capture (step) time."""
    store = stats.get("store", stats)
    parts = {"scheduling": stats["shard_seconds"] + stats.get("scheduling_seconds", 0.0),
             "write": store.get("write_seconds", 0.0), "commit": store.get("commit_seconds", 0.0)}
    per_shard = {f"{k}_ms_per_shard": 1e3 * v / shards for k, v in parts.items()}
    capture = stats["step_seconds"] / shards
    return {"capture_ms_per_shard": 1e3 * capture, **per_shard,
            "overhead_fraction": sum(parts.values()) / stats["step_seconds"]}


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=None, help="windows captured (default: 128)")
    p.add_argument("--context-size", type=int, default=None, help="tokens per window (default: 128)")
    p.add_argument("--shard-windows", type=int, default=None, help="windows per shard (default: 16)")
    p.add_argument("--layers", default="0,4", help="captured layers (default: 0,4)")
    p.add_argument("--replicas", type=int, default=2, help="also run on this many replicas (0: skip)")
    p.add_argument("--repeats", type=int, default=None, help="alternating one-shard / many-shard runs (default: 3)")
    args = p.parse_args(argv)
    path = common.setup("corpus_shards", args, {"windows": (128, 12), "context_size": (128, 16),
                                                "shard_windows": (16, 3), "repeats": (3, 1)})
    from steerable import capture_corpus

    layers = [int(x) for x in args.layers.split(",")]
    llm = common.make_llm(args, path)
    engine_layers = llm.llm_engine.model_config.num_layers
    layers = [layer for layer in layers if layer < engine_layers] or [0]
    rng = np.random.default_rng(args.seed)
    windows = rng.integers(0, common.prompt_vocab(llm), (args.windows, args.context_size))
    root = tempfile.mkdtemp(prefix="steerable-shards-")
    options = dict(format="saelens", context_size=args.context_size, layers=layers, dtype="float32",
                   batch_size=args.max_num_seqs)
    wall: dict[int, list[float]] = {}
    steps: dict[int, list[float]] = {}

    def run(mode: str, salt: str, warm: bool = False) -> None:
        shard = args.windows if mode == "one" else args.shard_windows
        out = os.path.join(root, salt)
        index, seconds = timed(lambda: capture_corpus(llm, windows, out, shard_size=shard, **options))
        shutil.rmtree(out)
        shards = len(index["shards"])
        if not warm:
            wall.setdefault(shards, []).append(seconds)
            steps.setdefault(shards, []).append(index["stats"]["step_seconds"])
            emit({"record": "run", "mode": mode, "shards": shards, "seconds": seconds,
                  "tok_s": windows.size / seconds, **overhead(index["stats"], shards), "stats": index["stats"]})

    try:
        common.interleaved(["one", "many"], run, args.repeats)
        (one, many) = sorted(wall)
        extra = (common.median(wall[many]) - common.median(wall[one])) / (many - one)
        shard_capture = common.median(steps[many]) / many
        emit({"record": "wall", "shards": [one, many], "median_seconds": [common.median(wall[one]),
                                                                         common.median(wall[many])],
              "extra_ms_per_shard": 1e3 * extra, "capture_ms_per_shard": 1e3 * shard_capture,
              "extra_fraction": extra / shard_capture})
        config = dataclasses.asdict(llm.llm_engine.config)
        llm.shutdown()
        if args.replicas > 1:
            out = os.path.join(root, "replicas")
            index, seconds = timed(lambda: capture_corpus(config, windows, out, shard_size=args.shard_windows,
                                                          replicas=args.replicas, **options))
            shards = len(index["shards"])
            emit({"record": "replicas", "replicas": args.replicas, "shards": shards, "seconds": seconds,
                  **overhead(index["stats"], shards), "stats": index["stats"]})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
