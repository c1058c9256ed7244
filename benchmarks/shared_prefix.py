"""The chat workload: shared-prefix attention against prefix caching off and on.

Shared-prefix attention on the chat workload: N chats share one system prompt, each adds its own
user turn and generates; three modes on ONE engine, interleaved (medians of --repeats rounds):
``cache_off`` (no request reads the prefix cache: every chat prefills and holds its own copy of the
system prompt), ``cache_on`` (prefix caching; decode attention still reads the shared blocks once
per row) and ``shared`` (prefix caching and shared-prefix attention: decode steps read the shared
blocks once for all rows). One engine keeps memory, graphs and kernels identical across modes: the
off mode sets ``skip_reading_prefix_cache``, the cache-on mode switches the step builder's detector
off. Ends with the shared mode's speedup over each. A GPU run whose shared mode took no shared
step exits non-zero.

    python -m benchmarks shared_prefix [--system-len 1200] [--num-requests 512]
        [--user-len 20 200] [--output-len 20 400] [--repeats 5]
"""

from __future__ import annotations

from functools import partial

import numpy as np

from . import common
from .common import emit, timed

MODES = ("cache_off", "cache_on", "shared")


def chat_workload(args, vocab: int) -> common.Workload:
    """One system prompt, then per chat U(user) own tokens; outputs U(output) tokens (seeded)."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.system_len).tolist()
    users = rng.integers(args.user_len[0], args.user_len[1] + 1, args.num_requests)
    outputs = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests).tolist()
    prompts = [system + rng.integers(0, vocab, int(n)).tolist() for n in users]
    return common.Workload(prompts, [len(p) for p in prompts], outputs)


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--system-len", type=int, default=None, help="tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians are reported")
    args = p.parse_args(argv)
    path = common.setup("shared_prefix", args, {"num_requests": (512, 12), "system_len": (1200, 48),
                                                "user_len": ((20, 200), (2, 12)), "output_len": ((20, 400), (2, 10))})
    llm = common.make_llm(args, path)
    engine = llm.llm_engine
    detector = engine.builder.shared_prefix  # None where the backend has no shared-prefix kernel (CPU)
    w = chat_workload(args, common.prompt_vocab(llm))

    def run(mode: str, salt: str, warm: bool = False) -> dict:
        engine.builder.shared_prefix = detector if mode == "shared" else None
        extra = [{"skip_reading_prefix_cache": mode == "cache_off"}] * len(w)
        before = engine.stats()
        if warm:
            common.warm_up(llm, w, args, salt, extra)
            return {}
        outs, seconds = timed(partial(llm.generate, w.prompts, common.sampling_params(w, salt, extra), use_tqdm=False))
        after = engine.stats()
        return {"seconds": seconds, "tokens": common.generated_tokens(outs),
                **{k: after[k] - before[k] for k in ("shared_prefix_steps", "num_steps", "prefix_cache_hit_tokens",
                                                     "graph_replays")}}

    results = common.interleaved(list(MODES), run, args.repeats)
    engine.builder.shared_prefix = detector
    medians = {}
    for mode in MODES:
        rounds = results[mode]
        medians[mode] = common.median([r["seconds"] for r in rounds])
        emit({"record": "run", "mode": mode, "requests": len(w), "repeats": args.repeats,
              "system_len": args.system_len, "seconds_all": [r["seconds"] for r in rounds],
              **{k: rounds[-1][k] for k in ("shared_prefix_steps", "num_steps", "prefix_cache_hit_tokens",
                                            "graph_replays")},
              **common.throughput(medians[mode], sum(w.input_lens), rounds[-1]["tokens"])})
    emit({"record": "ratio", "speedup_vs_cache_off": medians["cache_off"] / medians["shared"],
          "speedup_vs_cache_on": medians["cache_on"] / medians["shared"]})
    llm.shutdown()
    if detector is not None and not results["shared"][-1]["shared_prefix_steps"]:
        raise SystemExit("the shared mode ran no shared-prefix step")

