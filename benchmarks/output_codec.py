"""The engine pipe's cost per step: streamed outputs as increments against whole outputs (CPU).

The engine pipe's cost per step (``steerable serve``'s engine process): a step's streamed outputs
for ``--num-requests`` requests of growing length, built and pickled whole (``OutputProcessor.output``)
against built as increments (``OutputProcessor.increment``), engine side (build + pickle) and
server side (unpickle, and rebuild for increments: ``steerable.entrypoints.output_codec``), in the
same run; checks that the rebuilt outputs equal the engine's. Then the server side of a stream
whose consumer takes an output every 1, 2 or 3 steps (``ProcessAsyncLLM``'s streams fold the
increments in between and rebuild once), per step over the whole generation. CPU only: no model.

    python -m benchmarks output_codec [--num-requests 256] [--max-len 550]
"""

from __future__ import annotations

import pickle
import time

import numpy as np

from steerable.engine.output_processor import OutputProcessor, RequestGroup
from steerable.entrypoints.output_codec import OutputDecoder, merge_increments
from steerable.request import Request
from steerable.sampling_params import SamplingParams

from . import common
from .common import emit


def _groups(prompt: list[int], n: int) -> list[RequestGroup]:
    """Streamed requests as the engine holds them, one completion each."""
    groups = []
    for i in range(n):
        request = Request(f"r{i}-0", f"r{i}", None, prompt, SamplingParams(max_tokens=10**6), i, [])
        groups.append(RequestGroup(f"r{i}", [request], stream=True, increments=True))
        request.group = groups[-1]  # held weakly (steerable/request.py): the list keeps it
    return groups


def main(argv: list[str] | None = None) -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.setup("output_codec", args, {"min_len": (580, 8), "max_len": (550, 12)}, model=False)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, 150_000, args.min_len).tolist()  # --min-len: the prompt length here
    tokens = [rng.integers(0, 150_000, args.max_len).tolist() for _ in range(args.num_requests)]
    groups, decoder = _groups(prompt, args.num_requests), OutputDecoder()
    samples = {"whole": [], "increments": []}
    checkpoints = {max(1, args.max_len // 10), args.max_len // 2, args.max_len}
    takes = {every: ([OutputDecoder() for _ in groups], [None] * len(groups), [0.0]) for every in (1, 2, 3)}
    for k in range(1, args.max_len + 1):  # step k: every request has k generated tokens
        for group, t in zip(groups, tokens):
            request = group.children[0]
            request.all_token_ids.append(t[k - 1])
            request.output_text += "abcde"
            group.changed[request.index] = request  # as the engine marks a child that took a token
        t0 = time.perf_counter()
        outs = [OutputProcessor.output(g) for g in groups]
        whole = pickle.dumps(outs, protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        pickle.loads(whole)
        t2 = time.perf_counter()
        sent = pickle.dumps([OutputProcessor.increment(g) for g in groups], protocol=pickle.HIGHEST_PROTOCOL)
        t3 = time.perf_counter()
        rebuilt = [decoder.decode(e) for e in pickle.loads(sent)]
        t4 = time.perf_counter()
        if rebuilt != outs:
            raise SystemExit(f"step {k}: the rebuilt outputs differ from the engine's")
        for every, (decoders, folded, spent) in takes.items():
            t5 = time.perf_counter()
            for i, increment in enumerate(pickle.loads(sent)):
                folded[i] = increment if folded[i] is None else merge_increments(folded[i], increment)
                if k % every == 0 or k == args.max_len:
                    rebuilt[i] = decoders[i].decode(folded[i])
                    folded[i] = None
            spent[0] += time.perf_counter() - t5
            if (k % every == 0 or k == args.max_len) and rebuilt != outs:
                raise SystemExit(f"step {k}: outputs rebuilt from folded increments differ from the engine's")
        if k in checkpoints:
            samples["whole"].append((k, t1 - t0, t2 - t1, len(whole)))
            samples["increments"].append((k, t3 - t2, t4 - t3, len(sent)))
    for mode, rows in samples.items():
        for k, engine_s, server_s, size in rows:
            emit({"record": "step", "mode": mode, "requests": args.num_requests, "tokens": k,
                  "engine_ms": engine_s * 1e3, "server_ms": server_s * 1e3, "bytes": size})
    for every, (_, _, spent) in takes.items():
        emit({"record": "fold", "requests": args.num_requests, "tokens": args.max_len, "taken_every": every,
              "server_ms_per_step": spent[0] / args.max_len * 1e3})
    totals = {mode: [sum(r[i] for r in rows) for i in (1, 2)] for mode, rows in samples.items()}
    emit({"record": "ratio", "engine_side": totals["whole"][0] / totals["increments"][0],
          "server_side": totals["whole"][1] / totals["increments"][1]})

