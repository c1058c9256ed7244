"""Batch-1 decode ms/token, unsteered and with a vector at every layer.

Batch-1 decode latency (DESIGN.md §6): one greedy request, ignore_eos; decode ms/token =
(t(output_len) - t(1)) / (output_len - 1), so prefill cancels out. Median over repeats, unsteered
and steered (a vector at every layer, per request), in the same process.

    python -m benchmarks latency [--input-len 128] [--output-len 256] [--repeats 5]
"""

from __future__ import annotations

import numpy as np
import torch

from . import common
from .common import emit, timed


def main(argv: list[str] | None = None) -> None:
    from steerable import SamplingParams

    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vector-scale", type=float, default=0.05, help="std of the steering vector's entries")
    args = p.parse_args(argv)
    path = common.setup("latency", args, {"input_len": (128, 8), "output_len": (256, 16)})
    if args.output_len < 2:
        p.error("--output-len must be at least 2")
    llm = common.make_llm(args, path)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, common.prompt_vocab(llm), args.input_len).tolist()
    vector = torch.from_numpy(rng.standard_normal(llm.engine.model_config.hidden_size, dtype=np.float32)
                              * args.vector_scale)
    steering = {"post_mlp": {layer: vector for layer in llm.list_steerable_layers()["post_mlp"]}}
    calls = iter(range(1 << 30))

    def seconds(max_tokens: int, steered: bool) -> float:
        """One request, timed; a fresh cache_salt each call so the prompt is always prefilled."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, cache_salt=f"c{next(calls)}",
                                steering_vectors=steering if steered else None)
        outs, t = timed(lambda: llm.generate([prompt], params, use_tqdm=False))
        assert len(outs[0].outputs[0].token_ids) == max_tokens
        return t

    for steered in (False, True):  # warm-up: both lengths, both paths
        seconds(1, steered)
        seconds(args.output_len, steered)
    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for steered in (False, True):
            samples[steered].append((seconds(args.output_len, steered), seconds(1, steered)))
    base = None
    for steered in (False, True):
        ms = [(full - one) / (args.output_len - 1) * 1e3 for full, one in samples[steered]]
        base = base or common.median(ms)
        emit({"record": "latency", "mode": "steered" if steered else "unsteered", "input_len": args.input_len,
              "output_len": args.output_len, "repeats": args.repeats, "decode_ms_per_token": common.median(ms),
              "decode_ms_per_token_all": ms, "full_s": common.median([f for f, _ in samples[steered]]),
              "first_token_s": common.median([o for _, o in samples[steered]]),
              "overhead_pct": (common.median(ms) / base - 1) * 100})

