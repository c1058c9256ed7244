"""Which tiles make the grouped MoE GEMMs fastest on this card? (Writes the table the kernel reads.)

Tune the grouped MoE GEMMs' tiles for one shape on this device and write the table the kernel
reads (``steerable/layers/moe_tables/<device>.json``, see ``steerable/layers/moe_configs.py``).

For each token count: random routing of that many tokens (uniform over experts, as dummy weights
route), every candidate (block_m shared by both GEMMs; per GEMM block_n, block_k, group_m, warps,
stages) timed with CUDA events after a warm-up, the fastest kept, and the default configuration
timed beside it (``speedup_vs_default`` per token count). Each candidate's output is checked
against the default's before it may win. ``--budget-s`` bounds the sweep; token counts are tuned
in order of how much of a decode-heavy workload they carry, so an early stop still tunes the
decode batch sizes first.

    python -m benchmarks moe_tune [--experts 128 --hidden 2048 --intermediate 768 --top-k 8]
        [--tokens 256,128,...] [--budget-s 420] [--write]
"""

from __future__ import annotations

import itertools
import json
import time

import torch

from steerable.layers import moe_configs
from steerable.layers.fused_moe import _grouped_gemm, moe_align
from steerable.layers.moe_configs import TileConfig

from .. import common
from ..common import emit

QWEN3_30B_A3B = dict(experts=128, hidden=2048, intermediate=768, top_k=8)
SMOKE = dict(experts=8, hidden=64, intermediate=32, top_k=2)
DECODE_FIRST = "256,128,64,1,512,32,8,2048,16,8192,4,2,1024,4096"


def candidates(tokens: int, experts: int, top_k: int, smoke: bool) -> tuple[list[int], list[TileConfig]]:
    """(block_m values, per-GEMM tiles) worth timing at this token count."""
    if smoke:
        return [16], [TileConfig(), TileConfig(block_n=32, block_k=32)]
    per_expert = tokens * top_k / experts
    if per_expert <= 8:
        block_ms = [16]
    elif per_expert <= 64:
        block_ms = [16, 32, 64]
    else:
        block_ms = [64, 128]
    if per_expert <= 1:  # a few rows per expert: as many programs streaming weights as the SMs hold
        grid = itertools.product([16, 32, 64], [128, 256, 512], [1], [2, 4], [3, 4, 5])
    elif per_expert <= 64:  # the weights' bytes set the time: narrow tiles, deep pipelines
        grid = itertools.product([32, 64, 128], [64, 128, 256], [1], [4], [3, 4, 5])
    else:
        grid = itertools.product([64, 128, 256], [64, 128], [1, 8], [4, 8], [3, 4])
    return block_ms, [TileConfig(bn, bk, g, w, s) for bn, bk, g, w, s in grid]


def time_ms(fn, iters: int) -> float:
    if not torch.cuda.is_available():  # --smoke on a CPU, under the interpreter: wall time
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1000 / iters
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    for name, value in QWEN3_30B_A3B.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--tokens", default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--write", action="store_true", help="merge the winners into the device's table")
    args = p.parse_args(argv)
    common.setup("moe_tune", args, {"tokens": (DECODE_FIRST, "1,5"), "iters": (20, 1)}, model=False)
    shape = {**(SMOKE if args.smoke else QWEN3_30B_A3B),
             **{k: getattr(args, k) for k in QWEN3_30B_A3B if getattr(args, k) is not None}}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    E, H, I, k = shape["experts"], shape["hidden"], shape["intermediate"], shape["top_k"]
    g = torch.Generator(device=device).manual_seed(args.seed)
    gate_up = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * 0.02
    down = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * 0.02
    deadline = time.monotonic() + args.budget_s
    winners = {}
    for tokens in [int(t) for t in args.tokens.split(",")]:
        if time.monotonic() > deadline:
            emit({"record": "skipped", "tokens": tokens, "reason": "budget"})
            continue
        x = torch.randn(tokens, H, device=device, dtype=dtype, generator=g)
        experts = torch.rand(tokens, E, device=device, generator=g).topk(k, dim=-1).indices
        routing = torch.rand(tokens, k, device=device, generator=g).to(dtype).reshape(-1)
        block_ms, tiles = candidates(tokens, E, k, args.smoke)

        def run(block_m: int, which: str, tile: TileConfig, aligned):
            ids, block_expert = aligned
            if which == "gate_up":
                return lambda: _grouped_gemm(x, gate_up, ids, block_expert, tokens * k, k, None, True, block_m, tile)
            return lambda: _grouped_gemm(hidden, down, ids, block_expert, tokens * k, 1, routing, False, block_m, tile)

        default_m, default_gu, default_down = moe_configs.DEFAULT
        aligned = moe_align(experts, E, default_m)
        hidden = run(default_m, "gate_up", default_gu, aligned)()
        ref = {"gate_up": hidden, "down": run(default_m, "down", default_down, aligned)()}
        base = {w: time_ms(run(default_m, w, t, aligned), args.iters)
                for w, t in (("gate_up", default_gu), ("down", default_down))}
        best = None
        for block_m in block_ms:
            aligned = moe_align(experts, E, block_m)
            choice = {}
            for which in ("gate_up", "down"):
                timings = []
                for tile in tiles:
                    if time.monotonic() > deadline and timings:
                        break
                    fn = run(block_m, which, tile, aligned)
                    try:
                        out = fn()
                    except Exception as err:  # noqa: BLE001 - a tile the device cannot hold (shared memory)
                        emit({"record": "rejected", "tokens": tokens, "block_m": block_m, "gemm": which,
                              "tile": tile.to_json(), "error": type(err).__name__})
                        continue
                    err = ((out.float() - ref[which].float()).norm() / ref[which].float().norm().clamp_min(1e-12)).item()
                    if err > 1e-2:
                        raise SystemExit(f"tile {tile} at block_m {block_m} disagrees with the default: {err}")
                    timings.append((time_ms(fn, args.iters), tile))
                choice[which] = min(timings, key=lambda t: t[0])
            total = choice["gate_up"][0] + choice["down"][0]
            if best is None or total < best[0]:
                best = (total, block_m, choice)
        total, block_m, choice = best
        winners[tokens] = {"block_m": block_m, "gate_up": choice["gate_up"][1].to_json(),
                           "down": choice["down"][1].to_json()}
        emit({"record": "tuned", "tokens": tokens, **winners[tokens], "ms": total,
              "ms_gate_up": choice["gate_up"][0], "ms_down": choice["down"][0], "ms_default": sum(base.values()),
              "speedup_vs_default": sum(base.values()) / total,
              "weight_gb_per_s": (gate_up.numel() + down.numel()) * gate_up.element_size() / total / 1e6})
    key = moe_configs.shape_key(E, H, I, dtype)
    if args.write and device.type == "cuda" and winners:
        path = moe_configs.device_file(torch.cuda.get_device_name(device))
        path.parent.mkdir(parents=True, exist_ok=True)
        table = json.loads(path.read_text()) if path.exists() else {}
        table.setdefault(key, {}).update({str(t): w for t, w in sorted(winners.items())})
        table[key] = dict(sorted(table[key].items(), key=lambda item: int(item[0])))
        path.write_text(json.dumps(table, indent=1) + "\n")
        emit({"record": "written", "path": str(path), "key": key, "tokens": sorted(winners)})
    emit({"record": "table", "key": key, "entries": {str(t): w for t, w in sorted(winners.items())}})

