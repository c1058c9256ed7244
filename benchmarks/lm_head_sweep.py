"""The LM head's GEMM (``logits = h W^T``, W [vocab, hidden]) at decode batch sizes, in the forms
cuBLAS can be asked for, timed in one run with CUDA-graph replays: ``F.linear`` (what the engine
runs), the transposed product ``W h^T`` (cuBLAS then tiles the vocabulary as its M side: at a
few hundred rows the plain form picked one 192x192 tile for Gemma 2's 256k-row head, 0.65 ms a
step for a 0.28 ms read), the transposed product copied back to row-major, and the rows padded
to a multiple of 64. The weights (300 MB-1.2 GB) do not fit in L2, so each replay reads them.

    PYTHONPATH=. python benchmarks/lm_head_sweep.py
    --smoke: tiny shapes on the CPU, wall-clock timed: checks the script, not the speed.
"""

from __future__ import annotations

import common
import torch
import torch.nn.functional as F
from common import emit

SHAPES = {"gemma2-2b": (256000, 2304), "qwen3-0.6b": (151936, 1024), "qwen3-8b": (151936, 4096)}
SMOKE_SHAPES = {"tiny": (1000, 64)}
ROWS = (1, 16, 64, 128, 146, 192, 256)
SMOKE_ROWS = (1, 5)


def forms(h: torch.Tensor, w: torch.Tensor) -> dict:
    pad = -(-h.shape[0] // 64) * 64
    padded = torch.zeros(pad, h.shape[1], dtype=h.dtype, device=h.device)
    padded[:h.shape[0]] = h
    return {"linear": lambda: F.linear(h, w),
            "transposed": lambda: torch.mm(w, h.t()),
            "transposed_copy": lambda: torch.mm(w, h.t()).t().contiguous(),
            "padded_64": lambda: F.linear(padded, w)}


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    common.setup("lm_head_sweep", args, model=False)
    micros, device, dtype = common.kernel_timer("lm_head_sweep", args.smoke)
    torch.manual_seed(args.seed)
    for name, (vocab, hidden) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        w = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.02
        for rows in (SMOKE_ROWS if args.smoke else ROWS):
            h = torch.randn(rows, hidden, device=device, dtype=dtype)
            ref = F.linear(h, w)
            times = {}
            for form, fn in forms(h, w).items():
                out = fn()
                got = out.t() if form == "transposed" else out[:rows]
                if not torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2):
                    raise AssertionError(f"{form} differs from F.linear at {name}, {rows} rows")
                times[form] = micros(fn)
            read_us = w.numel() * w.element_size() / 4.3e12 * 1e6
            emit({"record": "lm_head", "shape": name, "vocab": vocab, "hidden": hidden, "rows": rows,
                  "us": times, "weight_read_us_at_4.3TBps": read_us,
                  "best": min(times, key=times.get), "vs_linear": {k: v / times["linear"] for k, v in times.items()}})


if __name__ == "__main__":
    main()
