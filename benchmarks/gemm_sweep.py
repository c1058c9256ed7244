"""The decode-batch GEMM kernel (``steerable/layers/skinny_gemm.py``) against cuBLAS on the
projections of the Qwen3-0.6B shape at decode batch sizes (bf16): the tiles ``skinny_linear``
picks, the best of a sweep of tile shapes, and cuBLAS (``F.linear``; for down_proj, the gated
activation kernel then ``F.linear``, which the kernel's gated prologue replaces). Each case is
timed as a CUDA graph of 28 launches over 28 copies of the weights (one per layer, so they come
from HBM as in the model, not from L2), replayed; figures are microseconds per launch.

    PYTHONPATH=. python benchmarks/gemm_sweep.py [--rows 8,32,64,128,256]
    --smoke: tiny shapes and two tile shapes under Triton's CPU interpreter (TRITON_INTERPRET=1
    STEERABLE_FUSED_ON_CPU=1), wall-clock timed: checks the script, not the kernel's speed.
"""

from __future__ import annotations

import itertools

import common
import torch
import torch.nn.functional as F
from common import emit, timed

from steerable.layers import fused, skinny_gemm
from steerable.layers.skinny_gemm import Tiles

# name -> (N, K, gated): Qwen3-0.6B's projections; down_proj takes the gate|up output
SHAPES = {"qkv": (4096, 1024, False), "o_proj": (1024, 2048, False), "gate_up": (6144, 1024, False),
          "down_proj": (1024, 3072, True)}
SMOKE_SHAPES = {"tiny": (40, 48, False), "tiny_gated": (24, 40, True)}
SWEEP = [Tiles(bm, bn, bk, split, 4, 3 if bk == 256 else 4)
         for bm, bn, bk, split in itertools.product([16, 32, 64], [32, 64, 128], [64, 128, 256], [1, 2, 4])]
SMOKE_SWEEP = [Tiles(16, 16, 16, 1, 4, 1), Tiles(16, 32, 16, 2, 4, 1)]
COPIES = 28


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated batch sizes (default 8,32,64,128,192,256)")
    args = p.parse_args()
    common.setup("gemm_sweep", args, model=False)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gemm_sweep times GPU kernels: run it on a CUDA machine (or --smoke on a CPU)")
    from triton.runtime.errors import OutOfResources

    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = [int(r) for r in (args.rows or ("3,17" if args.smoke else "8,32,64,128,192,256")).split(",")]
    copies = 2 if args.smoke else COPIES

    def per_launch_us(fn) -> float:
        if not cuda:
            return timed(fn)[1] * 1e6 / copies
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / 20 / copies

    torch.manual_seed(args.seed)
    for name, (n, k, gated) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, 2 * k if gated else k, device=device, dtype=dtype)
            xin = fused.silu_and_mul(x) if gated else x
            ref = F.linear(xin, weights[0])

            def cublas() -> None:
                for w in weights:
                    F.linear(fused.silu_and_mul(x) if gated else x, w)

            def kernel(tiles: Tiles | None):
                def run() -> None:
                    for w in weights:
                        skinny_gemm.skinny_linear(x, w, None, "silu" if gated else None, tiles)
                return run

            def error(tiles: Tiles | None) -> float:
                y = skinny_gemm.skinny_linear(x, weights[0], None, "silu" if gated else None, tiles)
                return (y.float() - ref.float()).abs().max().item()

            best = None
            for tiles in SMOKE_SWEEP if args.smoke else SWEEP:
                if tiles.block_m > max(16, m) * 2 or tiles.block_k * tiles.split_k > k:
                    continue
                try:
                    us = per_launch_us(kernel(tiles))
                except OutOfResources:  # the tiles need more shared memory than an SM has
                    continue
                if best is None or us < best[0]:
                    best = (us, tiles)
            chosen = skinny_gemm.pick_tiles(m, n, k)
            cublas_us, chosen_us = per_launch_us(cublas), per_launch_us(kernel(None))
            emit({"record": "projection", "shape": name, "rows": m, "n": n, "k": k, "gated": gated,
                  "cublas_us": cublas_us, "chosen_tiles": list(chosen), "chosen_us": chosen_us,
                  "chosen_err": error(None), "best_tiles": list(best[1]), "best_us": best[0],
                  "best_err": error(best[1]), "chosen_speedup": cublas_us / chosen_us,
                  "best_speedup": cublas_us / best[0], "weight_tb_per_s": n * k * weights[0].element_size() / chosen_us / 1e6})


if __name__ == "__main__":
    main()
