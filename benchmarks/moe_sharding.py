"""Which way to split a Qwen3-MoE expert layer over two tensor-parallel ranks (issue 11): each rank
holding half the experts whole (what ``models/qwen3_moe.py`` does), or every expert with half its
intermediate dimension. Times one rank's share of the layer's expert work, the slower rank of
the two, with the engine's dispatch loop (one host sync, a loop over the rank's active experts),
for decode-sized and prefill-sized batches; one rank holding everything is the baseline. No
communication is timed: both splits end in the same single all-reduce.

    PYTHONPATH=. python benchmarks/moe_sharding.py [--tokens 1,16,64,256,2048]
"""

from __future__ import annotations

import common
import torch
import torch.nn.functional as F
from common import emit, timed

QWEN3_30B_A3B = dict(hidden=2048, experts=128, top_k=8, intermediate=768)  # its MoE layer
SMOKE = dict(hidden=64, experts=8, top_k=2, intermediate=32)


def rank_share(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, first: int, num_experts: int) -> torch.Tensor:
    """The engine's expert loop over ``gate_up``/``down`` (the rank's experts ``first``... or all
    of them, sliced), zeros for assignments to other ranks' experts."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs, ws = x[order // top_k], weights.reshape(-1)[order]
    ys = torch.zeros_like(xs)
    start = sum(counts[:first])
    for e in range(gate_up.shape[0]):
        n = counts[first + e]
        if n:
            gate, up = F.linear(xs[start:start + n], gate_up[e]).chunk(2, dim=-1)
            ys[start:start + n] = F.linear(F.silu(gate) * up, down[e]) * ws[start:start + n, None]
            start += n
    out = torch.empty_like(ys)
    out[order] = ys
    return out.view(x.shape[0], top_k, -1).sum(dim=1)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", default=None, help="comma-separated batch sizes")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    common.setup("moe_sharding", args, {"tokens": ("1,16,64,256,2048", "1,8"), "iters": (20, 2)}, model=False)
    shape = SMOKE if args.smoke else QWEN3_30B_A3B
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h, e, k, i = shape["hidden"], shape["experts"], shape["top_k"], shape["intermediate"]
    g = torch.Generator(device=device).manual_seed(args.seed)

    def weights(experts: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(experts, 2 * inter, h, generator=g, device=device, dtype=dtype) * 0.02,
                torch.randn(experts, h, inter, generator=g, device=device, dtype=dtype) * 0.02)

    # (rank's experts, intermediate size, first expert per rank)
    splits = {"one_rank": (e, i, [0]), "experts_split": (e // 2, i, [0, e // 2]),
              "intermediate_split": (e, i // 2, [0])}  # both ranks of this split do the same work
    tables = {name: weights(n, inter) for name, (n, inter, _) in splits.items()}
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, h, generator=g, device=device, dtype=dtype)
        logits = torch.randn(tokens, e, generator=g, device=device, dtype=torch.float32)
        top, experts = torch.topk(logits.softmax(-1), k)
        top = top.to(dtype)
        record = {"record": "moe_layer", "tokens": tokens, **shape, "device": device}
        for name, (_, _, firsts) in splits.items():
            gate_up, down = tables[name]
            per_rank = []
            for first in firsts:
                rank_share(x, experts, top, gate_up, down, first, e)  # warm-up
                _, seconds = timed(lambda: [rank_share(x, experts, top, gate_up, down, first, e)
                                            for _ in range(args.iters)])
                per_rank.append(seconds / args.iters * 1e3)
            record[f"{name}_ms"] = max(per_rank)
        for name in ("experts_split", "intermediate_split"):
            record[f"{name}_speedup"] = record["one_rank_ms"] / record[f"{name}_ms"]
        emit(record)


if __name__ == "__main__":
    main()
