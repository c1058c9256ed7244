"""``LLM(...)`` and the first ``generate`` against a second one, in fresh processes.

Cold start: in a fresh process, the time of ``LLM(...)`` (which compiles the kernels and captures
the decode CUDA graphs), then the first ``generate`` of N requests and a second one of the same
shapes (its own baseline: a fresh cache salt, so it prefills again). Each repeat is a new process;
the first may also compile Triton's on-disk cache, later ones load it. Reports medians.

    python -m benchmarks cold_start [--num-requests 32] [--repeats 3]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from . import common, provenance
from .common import emit, timed

CHILD = "STEERABLE_COLD_START_CHILD"


def child(args, path: str) -> None:
    """One process: LLM(...), then two generates of the same workload; one record."""
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    init = llm.llm_engine.stats()
    _, first = timed(lambda: llm.generate(w.prompts, common.sampling_params(w, "first"), use_tqdm=False))
    after_first = llm.llm_engine.stats()
    _, second = timed(lambda: llm.generate(w.prompts, common.sampling_params(w, "second"), use_tqdm=False))
    emit({"record": "cold_start", "requests": len(w), "first_s": first, "second_s": second,
          "first_vs_second_pct": (first / second - 1) * 100,
          "graph_captures_at_init": init["graph_captures"],
          "graph_captures_in_first": after_first["graph_captures"] - init["graph_captures"],
          "graph_replays_in_first": after_first["graph_replays"] - init["graph_replays"]})


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes; medians are reported")
    child_argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(child_argv)
    if os.environ.get(CHILD):
        args.out = "-"  # the parent records the run
        child(args, common.setup("cold_start", args, {"num_requests": (32, 4)}))
        return
    common.setup("cold_start", args, {"num_requests": (32, 4)})
    runs = []
    for _ in range(args.repeats):
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "cold_start", *child_argv], cwd=provenance.ROOT,
                              capture_output=True, text=True, check=False, env={**os.environ, CHILD: "1"})
        if proc.returncode:
            raise SystemExit(f"cold-start child failed:\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in proc.stdout.splitlines()]
        run = {r["record"]: r for r in records}
        emit(run["llm_init"])
        runs.append({**run["cold_start"], "llm_init_s": run["llm_init"]["seconds"]})
        emit({**runs[-1], "record": "cold_start_run"})
    emit({"record": "cold_start", "repeats": args.repeats, "requests": runs[0]["requests"],
          **{key: common.median([r[key] for r in runs])
             for key in ("llm_init_s", "first_s", "second_s", "first_vs_second_pct")},
          "graph_captures_in_first": max(r["graph_captures_in_first"] for r in runs)})

