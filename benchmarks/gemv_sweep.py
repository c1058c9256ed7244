"""The one-row GEMV kernel (``steerable/layers/gemv.py``) against cuBLAS (``F.linear``) on the
projections of the Qwen3-0.6B and Qwen3-8B shapes, one input row, bf16: a sweep of tile shapes
(BLOCK_N, BLOCK_K, warps, stages), the best per projection, and the tiles ``gemv`` picks, all timed
in the same run with CUDA-graph replays (``triton.testing.do_bench_cudagraph``). The weights are
re-read each replay; at these sizes they stay in L2, so figures are lower than inside a model.

    PYTHONPATH=. python benchmarks/gemv_sweep.py
    --smoke: tiny shapes and two tile shapes under Triton's CPU interpreter (TRITON_INTERPRET=1
    STEERABLE_FUSED_ON_CPU=1), wall-clock timed: checks the script, not the kernel's speed.
"""

from __future__ import annotations

import itertools

import common
import torch
import torch.nn.functional as F
from common import emit

from steerable.layers import gemv

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down_proj": (1024, 3072),
          "8b_qkv": (6144, 4096), "8b_gate_up": (24576, 4096), "8b_down_proj": (4096, 12288)}
SMOKE_SHAPES = {"tiny": (40, 24)}
TILES = list(itertools.product([1, 2, 4, 8, 16, 32], [128, 256, 512, 1024], [2, 4, 8], [1, 2, 3, 4]))
SMOKE_TILES = [(2, 16, 4, 1), (8, 32, 4, 2)]


def run_tiles(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int]) -> torch.Tensor:
    block_n, block_k, warps, stages = tiles
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    gemv._gemv_kernel[(-(-n // block_n),)](x, w, w, y, n, k, w.stride(0), HAS_BIAS=False, GATED=False,
                                           GELU_TANH=False, PDL=False, BLOCK_N=block_n, BLOCK_K=block_k,
                                           num_warps=warps, num_stages=stages)
    return y


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    common.setup("gemv_sweep", args, model=False)
    micros, device, dtype = common.kernel_timer("gemv_sweep", args.smoke)
    torch.manual_seed(args.seed)
    for name, (n, k) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        x = torch.randn(1, k, device=device, dtype=dtype)
        ref = F.linear(x, w)
        cublas = micros(lambda: F.linear(x, w))
        best = None
        for tiles in SMOKE_TILES if args.smoke else TILES:
            if tiles[0] * tiles[1] > 16384:  # too many registers per program
                continue
            err = (run_tiles(x, w, tiles).float() - ref.float()).abs().max().item()
            us = micros(lambda: run_tiles(x, w, tiles))
            if best is None or us < best[0]:
                best = (us, tiles, err)
        chosen = micros(lambda: gemv.gemv(x, w))
        emit({"record": "projection", "shape": name, "n": n, "k": k, "cublas_us": cublas, "best_us": best[0],
              "best_tiles": best[1], "best_max_abs_err": best[2], "gemv_us": chosen,
              "gemv_err": (gemv.gemv(x, w).float() - ref.float()).abs().max().item(),
              "best_speedup": cublas / best[0], "gemv_speedup": cublas / chosen})


if __name__ == "__main__":
    main()
