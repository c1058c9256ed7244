"""Offline throughput of N random requests against HF ``generate``, with each step's byte roofline.

Offline throughput (DESIGN.md §6): N random requests through steerable (with CUDA graphs, and with
``--compare-eager`` again with ``enforce_eager=True``), then the same requests through HF
transformers ``generate`` in the same process, and the ratios. Where CUDA graphs are on, a run whose
engine replayed none exits non-zero (and an eager run that replayed some). Each steerable run also
prints a ``roofline`` record: the weight + KV bytes an engine step reads on average, the step time
that allows at the device's measured copy speed, and the measured step time.

    python -m benchmarks throughput [--shape qwen3-30b-a3b] [--num-requests 256] [--repeats R]
        [--compare-eager] [--hf-requests K] [--skip-hf]
"""

from __future__ import annotations

from functools import partial

import torch

from . import common
from .common import emit, timed


def run_steerable(args, path: str, eager: bool) -> tuple[dict, torch.dtype, common.Workload]:
    llm = common.make_llm(args, path, enforce_eager=eager)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    common.warm_up(llm, w, args)
    replays = llm.llm_engine.stats()["graph_replays"]
    times, steps = [], llm.llm_engine.stats()["num_steps"]
    for r in range(args.repeats):
        outs, seconds = timed(partial(llm.generate, w.prompts, common.sampling_params(w, f"timed-{r}"),
                                      use_tqdm=False))
        times.append(seconds)
    stats = llm.llm_engine.stats()
    result = {"record": "steerable", "enforce_eager": eager, "requests": len(w), "repeats": args.repeats,
              "seconds_all": times, "graph_replays_timed": stats["graph_replays"] - replays,
              **common.throughput(common.median(times), sum(w.input_lens), common.generated_tokens(outs))}
    emit(result)
    emit({"record": "engine_stats", "enforce_eager": eager, **stats})
    steps = (stats["num_steps"] - steps) // args.repeats  # each timed run schedules the same steps
    speed = common.copy_speed(llm.engine.device)
    emit({"record": "roofline", "enforce_eager": eager,
          **common.roofline(llm, path, w, common.median(times), steps, speed)})
    dtype = llm.engine.dtype
    graphs_expected = llm.engine.device.type == "cuda" and not eager
    llm.shutdown()
    del llm, outs  # the next engine and the HF baseline need the GPU memory the KV cache held
    common.free_cuda()
    if graphs_expected != (result["graph_replays_timed"] > 0):
        raise SystemExit(f"enforce_eager={eager}: {result['graph_replays_timed']} CUDA-graph replays in the timed runs")
    return result, dtype, w


def run_hf(args, path: str, dtype: torch.dtype, w: common.Workload) -> dict:
    """HF ``generate``: sdpa, left padding, batches of requests sorted by output length, each batch
    run to its longest output; only each request's own output length counts as useful tokens. A
    config-only shape gets HF's own random initialisation, on the device."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    held = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else 0.0  # what steerable failed to free
    if args.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **{dtype_kw: dtype},
                                                     attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: dtype}, attn_implementation="sdpa")
    model = model.to(device).eval()
    w = w.head(args.hf_requests or len(w))
    order = sorted(range(len(w)), key=lambda i: w.output_lens[i])
    batches = [order[i:i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]

    def generate(batch: list[int], max_new: int | None = None) -> None:
        width = max(w.input_lens[i] for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, width - w.input_lens[i]:] = torch.tensor(w.prompts[i])
            mask[row, width - w.input_lens[i]:] = 1
        new = max_new or max(w.output_lens[i] for i in batch)
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                       min_new_tokens=new, do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)

    with torch.inference_mode():
        generate(batches[0][:4], max_new=8)  # warm-up: kernels, allocator
        _, seconds = timed(lambda: [generate(b) for b in batches])
    result = {"record": "hf", "requests": len(w), "batch_size": args.hf_batch_size, "cuda_gib_held_before": held,
              **common.throughput(seconds, sum(w.input_lens), sum(w.output_lens))}
    emit(result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--hf-requests", type=int, default=None, help="run HF on the first K requests only")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--compare-eager", action="store_true", help="also time steerable with enforce_eager=True")
    p.add_argument("--repeats", type=int, default=1, help="timed steerable runs; the median is reported")
    args = p.parse_args(argv)
    path = common.setup("throughput", args, {"hf_batch_size": (64, 4)})
    ours, dtype, w = run_steerable(args, path, args.enforce_eager)
    if args.compare_eager and not args.enforce_eager:
        eager, _, _ = run_steerable(args, path, True)
        emit({"record": "graphs_vs_eager", "speedup": eager["seconds"] / ours["seconds"]})
    if args.skip_hf:
        return
    hf = run_hf(args, path, dtype, w)
    emit({"record": "ratio", "output_tok_s_ratio": ours["output_tok_s"] / hf["output_tok_s"],
          "total_tok_s_ratio": ours["total_tok_s"] / hf["total_tok_s"]})

