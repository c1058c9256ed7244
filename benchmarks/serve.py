"""``steerable serve`` under load (like ``vllm bench serve``) against the same requests offline.

Online serving (DESIGN.md §6), like ``vllm bench serve``: a fixed request set (throughput.py's
workload) through ``steerable serve`` at a maximum concurrency or a Poisson request rate, streamed
by ``--client-processes`` client processes; output tok/s, TTFT and ITL p50/p99. The offline
baseline runs first in this process on the same requests: throughput.py's measurement, and at
concurrency 1 each request alone as latency.py times it, so the ratios hold on a shared machine.

    python -m benchmarks serve [--num-requests 256] [--max-concurrency C | --request-rate R]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass, field
from functools import partial

import httpx
import numpy as np

from steerable.entrypoints.openai.launcher import ServerProcess

from . import common
from .common import emit, timed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- offline baseline

def run_offline(args, llm, w: common.Workload) -> dict:
    """throughput.py's run on the fixed requests; at concurrency 1 also each request's decode
    ms/token alone, (t(n) - t(1)) / (n - 1) as latency.py measures it. Frees ``llm`` afterwards."""
    from steerable import SamplingParams

    def alone(prompt: list[int], n: int, salt: str) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, cache_salt=salt)
        return timed(lambda: llm.generate([prompt], params, use_tqdm=False))[1]

    try:
        common.warm_up(llm, w, args)
        outs, seconds = timed(partial(llm.generate, w.prompts, common.sampling_params(w, "offline-timed"),
                                      use_tqdm=False))
        result = {"record": "offline", "requests": len(w),
                  **common.throughput(seconds, sum(w.input_lens), common.generated_tokens(outs))}
        if args.max_concurrency == 1:
            ms = [(alone(prompt, n, f"alone-{i}") - alone(prompt, 1, f"one-{i}")) / (n - 1) * 1e3
                  for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens))]
            result["decode_ms_per_token"] = common.median(ms)
        emit(result)
        return result
    finally:
        llm.shutdown()
        common.free_cuda()  # the server needs the memory the KV cache held


# ---------------------------------------------------------------- the server

def server_process(args, path: str, extra: list[str] = ()) -> ServerProcess:
    """``steerable serve`` with the engine flags of the offline run (and ``extra`` flags)."""
    flags = ["--log-level", "warning", "--dtype", args.dtype, "--device", args.device, "--max-num-seqs",
             str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed), *extra]
    if args.kv_cache_tokens is not None:
        flags += ["--kv-cache-tokens", str(args.kv_cache_tokens)]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    return ServerProcess(path, flags, os.path.join(args.cache_dir, f"serve-{os.getpid()}.log"), env,
                         args.startup_timeout)


# ---------------------------------------------------------------- the load

@dataclass
class Result:
    prompt_len: int
    start: float
    times: list[float] = field(default_factory=list)  # arrival of each generated token
    chunks: int = 0  # server-sent events received
    error: str | None = None


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, salt: str) -> Result:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.6, "ignore_eos": True, "stream": True,
            "cache_salt": salt, "return_token_ids": True}
    result = Result(len(prompt), time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return result
        pending = b""
        async for data in r.aiter_bytes():  # whole network reads: per-line iteration costs the client more
            now = time.perf_counter()
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                result.chunks += 1
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    continue
                for choice in chunk["choices"]:
                    result.times.extend([now] * len(choice.get("token_ids", ())))
    return result


async def run_load(url: str, w: common.Workload, salt: str, max_concurrency: int | None,
                   request_rate: float | None, seed: int) -> tuple[list[Result], float, float]:
    """Every request of ``w``: at most ``max_concurrency`` in flight, arriving as a Poisson process
    of ``request_rate`` per second when given. Returns the results, the seconds it took and the CPU
    seconds this client spent meanwhile (near the former, the client is the bottleneck)."""
    limit = asyncio.Semaphore(max_concurrency or len(w))
    rng = np.random.default_rng(seed)
    connections = httpx.Limits(max_connections=max_concurrency or len(w), max_keepalive_connections=None)

    async def limited(i: int) -> Result:
        async with limit:
            return await one_request(client, w.prompts[i], w.output_lens[i], f"{salt}-{i}")

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=connections) as client:
        start, cpu = time.perf_counter(), time.process_time()
        tasks = []
        for i in range(len(w)):
            tasks.append(asyncio.ensure_future(limited(i)))
            if request_rate:
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, time.process_time() - cpu


def run_load_processes(url: str, w: common.Workload, salt: str, max_concurrency: int | None,
                       request_rate: float | None, seed: int, processes: int,
                       timeout: float = 600.0) -> tuple[list[Result], float, float]:
    """``run_load`` spread over ``processes`` client processes, so the load generator's own Python
    (an SSE event costs an httpx client tens of microseconds) is not what gets measured: request i
    goes to process i mod P, the concurrency limit and the arrival rate are split between them (P
    Poisson processes of rate r/P make one of rate r). All start together; the run ends with the
    last response. CPU seconds are summed over the clients."""
    processes = min(processes, max_concurrency or processes, len(w))
    context = multiprocessing.get_context("spawn")
    go, results = context.Event(), context.Queue()
    clients = []
    for k in range(processes):
        part = common.Workload(w.prompts[k::processes], w.input_lens[k::processes], w.output_lens[k::processes])
        limit = None if max_concurrency is None else max_concurrency // processes + (k < max_concurrency % processes)
        rate = None if request_rate is None else request_rate / processes
        clients.append(context.Process(target=_client, args=(k, url, part, f"{salt}-p{k}", limit, rate, seed + k,
                                                              go, results), daemon=True))
    try:
        for client in clients:
            client.start()
        ready = [results.get(timeout=timeout) for _ in clients]  # started (not part of the run), waiting on go
        assert all(r == "ready" for r in ready), ready
        start = time.perf_counter()
        go.set()
        parts = [results.get(timeout=timeout) for _ in clients]
    except queue.Empty:
        raise SystemExit("a client process did not answer in time") from None
    finally:
        for client in clients:
            client.join(30)
            if client.is_alive():
                client.kill()
                client.join(30)
    merged: list[Result | None] = [None] * len(w)
    for k, part_results, _, _ in parts:
        merged[k::processes] = part_results
    return merged, max(end for _, _, end, _ in parts) - start, sum(cpu for _, _, _, cpu in parts)


def _client(k: int, url: str, w: common.Workload, salt: str, max_concurrency: int | None,
            request_rate: float | None, seed: int, go, results) -> None:
    """One client process of ``run_load_processes``."""
    results.put("ready")
    go.wait()
    part, _, cpu = asyncio.run(run_load(url, w, salt, max_concurrency, request_rate, seed))
    results.put((k, part, time.perf_counter(), cpu))


def summarize(results: list[Result], seconds: float, client_cpu: float, args) -> dict:
    done = [r for r in results if r.error is None and r.times]
    ttft = [(r.times[0] - r.start) * 1e3 for r in done]
    itl = np.concatenate([_gaps_ms(r.times) for r in done]) if done else np.zeros(0)
    output = sum(len(r.times) for r in done)

    def pct(values, q: float) -> float | None:
        return float(np.percentile(values, q)) if len(values) else None

    return {"record": "serve", "requests": len(results), "failed": len(results) - len(done),
            "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
            "client_processes": getattr(args, "client_processes", 1), "seconds": seconds,
            "output_tokens": output, "input_tokens": sum(r.prompt_len for r in done), "output_tok_s": output / seconds,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "itl_ms_p50": pct(itl, 50),
            "itl_ms_p99": pct(itl, 99), "itl_ms_mean": float(np.mean(itl)) if len(itl) else None,
            "chunks": sum(r.chunks for r in results), "client_cpu_s": client_cpu,
            "errors": sorted({r.error for r in results if r.error})[:5]}


def _gaps_ms(times: list[float]) -> np.ndarray:
    """Inter-token latencies of one request. Tokens that arrive in one chunk share its time: the
    gap before the chunk is spread over them, as a token-by-token client would see on average.
    Tokens of the first chunk count towards TTFT only."""
    arrivals, counts = np.unique(np.asarray(times), return_counts=True)
    return np.repeat(np.diff(arrivals) / counts[1:], counts[1:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the server may take to start")
    p.add_argument("--client-processes", type=int, default=4,
                   help="client processes sharing the load: on an H200 one httpx client spent 5.9 CPU seconds of a "
                        "6.9 s run at saturation, measuring itself (1: one client in this process)")
    args = p.parse_args(argv)
    if args.client_processes < 1:
        p.error(f"--client-processes: at least 1, got {args.client_processes}")
    path = common.setup("serve", args)
    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    offline = run_offline(args, llm, w)
    del llm
    with server_process(args, path) as server:
        warm = w.head(min(len(w), args.warmup_requests or args.max_num_seqs))
        warm = common.Workload(warm.prompts, warm.input_lens, [min(n, 32) for n in warm.output_lens])
        asyncio.run(run_load(server.url, warm, "serve-warmup", args.max_concurrency, None, args.seed))
        if args.client_processes > 1:
            results, seconds, client_cpu = run_load_processes(server.url, w, "serve-timed", args.max_concurrency,
                                                              args.request_rate, args.seed, args.client_processes)
        else:
            results, seconds, client_cpu = asyncio.run(run_load(server.url, w, "serve-timed", args.max_concurrency,
                                                                args.request_rate, args.seed))
    serve = summarize(results, seconds, client_cpu, args)
    emit(serve)
    ratio = {"record": "ratio", "output_tok_s_ratio": serve["output_tok_s"] / offline["output_tok_s"]}
    if "decode_ms_per_token" in offline and serve["itl_ms_p50"] is not None:
        ratio["itl_p50_over_offline_ms_per_token"] = serve["itl_ms_p50"] / offline["decode_ms_per_token"]
    emit(ratio)

