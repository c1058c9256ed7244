"""Whether the unified attention kernel of two source trees compiles to the same sm_90 instructions
for the dense decode path (bf16, GQA 2, head size 128, 128-key tiles: the Qwen3-0.6B shape's
decode steps): a change that adds a constexpr-guarded path (shared-prefix attention's resume)
costs the dense workload nothing when, with the path off, not one instruction differs. Parameter
declarations, register names and debug sections are left out; CPU only (Triton compiles for
Hopper without a GPU).

    python benchmarks/unified_ptx_diff.py --old-tree DIR   (DIR: e.g. `git archive REV steerable | tar -x -C DIR`)
"""

from __future__ import annotations

import difflib
import os
import re
import sys

import common
from common import emit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decode_ptx(tree: str, resume: bool = False) -> list[str]:
    """The kernel's instruction lines as ``tree``'s steerable compiles them, off every optional path
    (``resume``: with the shared-prefix resume on, where the tree has it)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_kernel_compile import BF16, FP32, I32, compile_for_hopper

    sys.path.insert(0, tree)
    for name in [m for m in sys.modules if m == "steerable" or m.startswith("steerable.")]:
        del sys.modules[name]
    from steerable.layers.attention_backends import triton_paged
    sys.path.remove(tree)
    optional = {"prefix_lens_ptr": I32, "ws_acc_ptr": FP32, "ws_max_ptr": FP32, "ws_sum_ptr": FP32, "stride_wab": 1,
                "stride_wah": 1, "stride_wmb": 1, "stride_wmh": 1, "RESUME": False, "SKIP_SINGLE": False}
    args = dict(q_ptr=BF16, k_cache_ptr=BF16, v_cache_ptr=BF16, out_ptr=BF16, qsl_ptr=I32, seq_lens_ptr=I32,
                block_table_ptr=I32, num_seqs=1, qk_scale=1.0, softcap=1.0, v_scale=1.0, window=1, stride_qt=1,
                stride_qh=1, stride_ot=1, stride_oh=1, stride_kb=1, stride_ko=1, stride_kh=1, stride_vb=1,
                stride_vo=1, stride_vh=1, stride_vd=1, stride_bt=1, NUM_Q_PER_KV=2, GQA_PAD=2, BLOCK_Q=1,
                BLOCK_M=16, HEAD_D=128, D_PAD=128, BLOCK_SIZE=16, TILE_N=128, USE_WINDOW=False, DOT_PREC="tf32",
                NUM_KV_HEADS=8, ONE_TOKEN_PER_SEQ=True, FP16_TILES=False, V_BY_BLOCK=False, SOFTCAP=False)
    kernel = triton_paged._unified_attention_kernel
    args.update({p.name: optional[p.name] for p in kernel.params if p.name in optional})
    if "RESUME" in args:
        args["RESUME"] = resume
    ptx = compile_for_hopper(kernel, **args).split(".section")[0]
    keep = [line for line in ptx.splitlines()
            if not line.strip().startswith((".param", "//", ".loc", ".file")) and "_param_" not in line]
    return [re.sub(r"%\w+", "%r", line) for line in keep]


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--old-tree", default=None,
                   help="a directory holding another revision's steerable/ (default: this one)")
    p.add_argument("--resume", action="store_true",
                   help="this tree's kernel with its resume path on (the diff must see it)")
    args = p.parse_args()
    common.setup("unified_ptx_diff", args, model=False)
    old = decode_ptx(os.path.abspath(args.old_tree or ROOT))
    new = decode_ptx(ROOT, args.resume)
    differ = [line for line in difflib.unified_diff(old, new, lineterm="", n=0)
              if not line.startswith(("---", "+++", "@@"))]
    emit({"record": "ptx", "old_tree": args.old_tree, "resume": args.resume, "old_lines": len(old),
          "new_lines": len(new), "differing_lines": len(differ), "first_differences": differ[:20]})


if __name__ == "__main__":
    main()
