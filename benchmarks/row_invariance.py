"""Whether a row of ``tl.dot`` and of ``tl.sum`` over a dot-shaped tile comes out with the same bits
whatever the number of rows in the tile and of warps in the program: what decides the program
shape in which shared-prefix attention's shared pass reproduces the unified decode kernel bit for
bit. (On the H200: dots at every shape, sums only at the same rows and warps.)

For head sizes 64 and 128 and key tiles of 64 and 128, one program computes, for its first 16 query
rows, S = Q K^T, P = exp2(S - rowmax), l = rowsum(P) and O = P V (bf16 in, fp32 accumulators), at
16 to 128 rows and 1 to 8 warps; each result is compared with 16 rows and 4 warps, the unified
decode kernel's shape. One record per (head size, tile), listing the shapes that differ.

    python benchmarks/row_invariance.py        (--smoke: the Triton interpreter on a CPU)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import common
import torch
import triton
import triton.language as tl
from common import emit


@triton.jit
def _tile_kernel(q_ptr, k_ptr, v_ptr, s_ptr, l_ptr, o_ptr, M: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    om = tl.arange(0, M)
    on = tl.arange(0, N)
    od = tl.arange(0, D)
    q = tl.load(q_ptr + om[:, None] * D + od[None, :])
    k = tl.load(k_ptr + on[:, None] * D + od[None, :])
    v = tl.load(v_ptr + on[:, None] * D + od[None, :])
    s = tl.dot(q, tl.trans(k), input_precision="tf32")
    p = tl.math.exp2(s - tl.max(s, 1)[:, None])
    tl.store(s_ptr + om[:, None] * N + on[None, :], s)
    tl.store(l_ptr + om, tl.sum(p, 1))
    tl.store(o_ptr + om[:, None] * D + od[None, :], tl.dot(p.to(v.dtype), v, input_precision="tf32"))


def first_rows(q, k, v, rows: int, warps: int) -> tuple[torch.Tensor, ...]:
    n, d = k.shape
    s = torch.empty(rows, n, device=q.device)
    l = torch.empty(rows, device=q.device)
    o = torch.empty(rows, d, device=q.device)
    _tile_kernel[(1,)](q, k, v, s, l, o, M=rows, N=n, D=d, num_warps=warps)
    return s[:16], l[:16], o[:16]


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    args = p.parse_args()
    common.setup("row_invariance", args, model=False)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16  # the interpreter has no bf16 dot
    shapes = [(16, 4), (64, 4)] if args.smoke else [(m, w) for m in (16, 32, 64, 128) for w in (1, 2, 4, 8)]
    g = torch.Generator().manual_seed(args.seed)
    for d in (64, 128):
        for n in (64, 128):
            q, k, v = (torch.randn(rows, d, generator=g).to(device, dtype) for rows in (128, n, n))
            ref = first_rows(q, k, v, 16, 4)
            differ = {name: [] for name in ("scores", "row_sums", "outputs")}
            for rows, warps in shapes:
                got = first_rows(q, k, v, rows, warps)
                for name, a, b in zip(differ, got, ref):
                    if not torch.equal(a, b):
                        differ[name].append(f"{rows}x{warps}")
            emit({"record": "tile", "head_d": d, "tile_n": n, "shapes": [f"{r}x{w}" for r, w in shapes],
                  **{f"{name}_differ_at": bad for name, bad in differ.items()}})


if __name__ == "__main__":
    main()
