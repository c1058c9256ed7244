"""Which chunk size, switch interval, sink thread and stream priority speed a GPU dashboards pass (issue 49)?

The dashboards benchmark's setup (a random jumprelu SAE of ``--d-sae`` features calibrated to
``--l0`` active a token, texts of ``--text-len`` random tokens): sparse corpus capture once as the
baseline, then one dashboards pass for every combination of ``--chunk-rows``, ``--switch-intervals``
(the interval a run on a GPU sets, ``long_runs.RUN_SWITCH_INTERVAL_S``; Python's default is 5 ms),
``--sinks`` (``threaded``: rows are filed and chunks encoded on the capture plane's sink thread, as
shipped; ``engine``: on the engine's thread, between steps) and ``--stream-priorities`` (the CUDA
priority of the accumulator's stream, ``DeviceAccumulator.stream_priority``: -1 as shipped, 0
level with the engine's kernels), each after a warm-up on a fiftieth of the corpus. One record per
combination: its seconds and its speed as a fraction of sparse capture's.

    python -m benchmarks dashboards_chunks [--tokens 1000000] [--chunk-rows 8192] [--sinks threaded,engine]
"""

from __future__ import annotations

import itertools

from benchmarks import common
from benchmarks.common import emit, timed
from benchmarks.dashboards import corpus, random_sae, sparse_capture, workload_parser


def main(argv: list[str] | None = None) -> None:
    p = workload_parser(__doc__.splitlines()[0], default_tokens="1,000,000")
    p.add_argument("--chunk-rows", default=None, help="comma-separated (default 8192; --smoke 40,64)")
    p.add_argument("--switch-intervals", default="0.0001", help="seconds, comma-separated")
    p.add_argument("--sinks", default="threaded,engine", help="where the sink runs: threaded and/or engine")
    p.add_argument("--stream-priorities", default="0,-1", help="CUDA priorities of the accumulator's stream")
    args = p.parse_args(argv)
    path = common.setup("dashboards_chunks", args, {
        "d_sae": (65536, 512), "layer": (14, 1), "tokens": (1_000_000, 3072), "text_len": (128, 24),
        "batch_size": (256, 16), "shard_size": (2048, 16), "chunk_rows": ("8192", "40,64")})
    from steerable import feature_dashboards, long_runs
    from steerable.sae.dashboards import accumulate, driver

    llm = common.make_llm(args, path)
    texts = corpus(args.tokens, args.text_len, common.prompt_vocab(llm), args.seed)
    llm.register_sae("sae", random_sae(llm, texts, args.d_sae, args.layer, args.l0, args.seed))
    head = texts[:max(1, len(texts) // 50)]
    sparse_capture(llm, head, args)
    baseline = sparse_capture(llm, texts, args)
    emit({"record": "baseline", "mode": "sparse_capture", "tokens": len(texts) * args.text_len, "seconds": baseline})
    for rows, interval, sink, priority in itertools.product(
            [int(x) for x in args.chunk_rows.split(",")], [float(x) for x in args.switch_intervals.split(",")],
            args.sinks.split(","), [int(x) for x in args.stream_priorities.split(",")]):
        if sink not in ("threaded", "engine"):
            raise SystemExit(f"--sinks: 'threaded' or 'engine', not {sink!r}")
        long_runs.RUN_SWITCH_INTERVAL_S = interval
        driver._Pass.threaded = sink == "threaded"
        accumulate.DeviceAccumulator.stream_priority = priority

        def dashboards(part, rows=rows):
            return feature_dashboards(llm, part, "sae", batch_size=args.batch_size, chunk_rows=rows)

        dashboards(head)
        _, seconds = timed(lambda: dashboards(texts))
        emit({"record": "pass", "chunk_rows": rows, "switch_interval_s": interval, "sink": sink,
              "stream_priority": priority, "seconds": seconds, "dashboards_vs_sparse_capture": baseline / seconds})
    llm.shutdown()
