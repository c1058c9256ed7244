"""KV bytes of one long request on a sliding-window model, against a cache without window release.

KV-cache memory of one long request on a model with sliding-window layers (Gemma 3 by default):
the most KV bytes in use at any step (prefill chunks hold a chunk on every layer) and while it
decodes, against what a cache without window release holds for the same context (every token of
every layer; known exactly, so it is computed rather than run).

    python -m benchmarks kv_memory [--shape gemma3-270m] [--context 32768] [--output-len 64]
"""

from __future__ import annotations

import numpy as np

from steerable import SamplingParams
from steerable.kv_groups import KVGroups

from . import common
from .common import emit, timed


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=None, help="prompt + output tokens of the request")
    p.add_argument("--output-len", type=int, default=None)
    args = p.parse_args(argv)
    if args.model is None and args.shape == "qwen3-0.6b":
        args.shape = "gemma3-270m"  # the default model has no windows to measure
    path = common.setup("kv_memory", args, {"context": (32768, 200), "output_len": (64, 8)})
    llm = common.make_llm(args, path)
    engine = llm.llm_engine
    cfg = engine.model_config
    groups = KVGroups.for_model(cfg)
    block_size = engine.config.block_size
    block_bytes = engine.stats()["kv_cache_bytes"] // engine.stats()["num_blocks"]
    prompt = np.random.default_rng(args.seed).integers(0, common.prompt_vocab(llm), args.context - args.output_len)
    engine.add_request("long", prompt.tolist(), SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    in_use: list[int] = []  # blocks after each step while the request still holds them

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            if stats["num_running"]:
                in_use.append(stats["num_blocks"] - stats["num_free_blocks"])

    _, seconds = timed(run)
    layer_block_bytes = block_bytes // groups.slots
    full_bytes = -(-args.context // block_size) * cfg.num_layers * layer_block_bytes
    peak, decode = max(in_use), in_use[-1]
    emit({"record": "kv_memory", "context": args.context, "block_size": block_size, "seconds": seconds,
          "max_num_batched_tokens": engine.config.max_num_batched_tokens, "groups": groups.num_groups,
          "layers_per_block": groups.slots, "windows": sorted({w for w in groups.windows if w is not None}),
          "peak_blocks": peak, "peak_kv_bytes": peak * block_bytes, "decode_kv_bytes": decode * block_bytes,
          "full_attention_kv_bytes": full_bytes,
          "bound_blocks": groups.blocks_needed(args.context, block_size, engine.config.max_num_batched_tokens),
          "peak_saving": full_bytes / (peak * block_bytes), "decode_saving": full_bytes / (decode * block_bytes)})

