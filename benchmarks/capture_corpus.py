"""Corpus capture (every layer, every prompt position, into shards) against HF ``output_hidden_states``.

Corpus capture (DESIGN.md §6): prompt tokens/s capturing every layer at every prompt position into
safetensors shards, steerable's ``capture_corpus`` vs HF ``output_hidden_states`` writing the same
data (same shards: one tensor per layer plus example/position/token-id labels, same dtype), in the
same run. Rows per shard must agree (exit non-zero otherwise); where the dtype is float32 the values
of every layer but the last (HF normalises its last entry) must agree too. ``--repeats N`` runs each
side N times (each run's shards deleted before the next, so later runs reuse freed pages; the last
run's are compared) and reports the ratio of the medians.

    python -m benchmarks capture_corpus [--num-requests 256] [--shard-size 64] [--repeats 3]
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import common
from .common import emit, timed


def out_root(args, path: str) -> str:
    """Shards go to RAM (/dev/shm) when it has room for both runs, so the run measures capture
    rather than the disk; otherwise to the temp dir. ``--out-dir`` decides explicitly."""
    base = args.out_dir
    if base is None and os.path.isdir("/dev/shm"):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        tokens = args.num_requests * (args.min_len + args.max_len) / 2
        needed = 3 * tokens * cfg["num_hidden_layers"] * cfg["hidden_size"] * 4  # both sides + warm-up, fp32 bound
        base = "/dev/shm" if shutil.disk_usage("/dev/shm").free > needed else None
    root = tempfile.mkdtemp(prefix="steerable-corpus-", dir=base)
    emit({"record": "storage", "dir": root, "free_gb": shutil.disk_usage(root).free / 1e9})
    return root


def run_steerable(args, path: str, root: str) -> tuple[dict, torch.dtype, list[int], common.Workload]:
    from steerable.capture.corpus import capture_corpus

    llm = common.make_llm(args, path)
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len, common.prompt_vocab(llm))
    layers = llm.list_steerable_layers()["post_mlp"]
    kwargs = dict(layers=layers, select="all_prompt", shard_size=args.shard_size, batch_size=args.shard_size)
    warm = w.head(min(len(w), args.shard_size))
    capture_corpus(llm, warm.prompts, os.path.join(root, "warmup"), **kwargs)  # every prefill shape once
    results = []
    for repeat in range(args.repeats):
        index, seconds = timed(lambda: capture_corpus(llm, w.prompts, os.path.join(root, "steerable"), **kwargs))
        results.append({"record": "run", "mode": "steerable", "repeat": repeat, "layers": len(layers),
                        "shards": len(index["shards"]), "rows": sum(e["rows"] for e in index["shards"]),
                        **rates(seconds, w, root, "steerable")})
        emit(results[-1])
        if repeat + 1 < args.repeats:
            shutil.rmtree(os.path.join(root, "steerable"))
    result = median_run(results)
    dtype = llm.engine.dtype
    llm.shutdown()  # the HF baseline needs the GPU memory the model and KV cache held
    common.free_cuda()
    return result, dtype, layers, w


def run_hf(args, path: str, dtype: torch.dtype, w: common.Workload, layers: list[int], root: str) -> dict:
    """HF: right-padded batches (each shard's examples sorted by length, kind to HF), the base
    model's ``output_hidden_states`` (no logits), every prompt row of ``hidden_states[L + 1]`` to
    the host, one safetensors shard per ``shard_size`` examples."""
    import transformers
    from transformers import AutoModelForCausalLM

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: dtype}, attn_implementation="sdpa")
    base = model.to(device).eval().model
    out = os.path.join(root, "hf")
    os.makedirs(out)

    def shard(k: int) -> int:
        examples = range(k * args.shard_size, min((k + 1) * args.shard_size, len(w)))
        rows: dict[int, list] = {layer: [] for layer in layers}
        per_example = {}
        for start in range(0, len(examples), args.hf_batch_size):
            batch = sorted(examples, key=lambda i: -w.input_lens[i])[start:start + args.hf_batch_size]
            width = w.input_lens[batch[0]]
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, :w.input_lens[i]] = torch.tensor(w.prompts[i])
                mask[row, :w.input_lens[i]] = 1
            hidden = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                          use_cache=False).hidden_states
            for layer in layers:
                host = hidden[layer + 1].cpu()
                for row, i in enumerate(batch):
                    per_example[(layer, i)] = host[row, :w.input_lens[i]]
        for layer in layers:
            rows[layer] = [per_example[(layer, i)] for i in examples]
        tensors = {f"layer.{layer}": torch.cat(parts) for layer, parts in rows.items()}
        tensors["example"] = torch.cat([torch.full((w.input_lens[i],), i) for i in examples])
        tensors["position"] = torch.cat([torch.arange(w.input_lens[i]) for i in examples])
        tensors["token_id"] = torch.cat([torch.tensor(w.prompts[i]) for i in examples])
        save_file(tensors, os.path.join(out, f"shard-{k:05d}.safetensors"))
        return len(tensors["example"])

    num_shards = -(-len(w) // args.shard_size)
    results = []
    with torch.inference_mode():
        base(input_ids=torch.tensor([w.prompts[0][:8]], device=device), output_hidden_states=True)  # warm-up
        for repeat in range(args.repeats):
            if repeat:
                shutil.rmtree(out)
                os.makedirs(out)
            counts, seconds = timed(lambda: [shard(k) for k in range(num_shards)])
            results.append({"record": "run", "mode": "hf", "repeat": repeat, "batch_size": args.hf_batch_size,
                            "shards": num_shards, "rows": sum(counts), **rates(seconds, w, root, "hf")})
            emit(results[-1])
    return median_run(results)


def median_run(results: list[dict]) -> dict:
    """The run of median time (the lower middle one of an even count)."""
    return sorted(results, key=lambda r: r["seconds"])[(len(results) - 1) // 2]


def rates(seconds: float, w: common.Workload, root: str, mode: str) -> dict:
    folder = os.path.join(root, mode)
    written = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return {"seconds": seconds, "prompt_tokens": sum(w.input_lens), "prompt_tok_s": sum(w.input_lens) / seconds,
            "gb_written": written / 1e9, "gb_s": written / 1e9 / seconds}


def compare(root: str, layers: list[int], exact: bool) -> dict:
    """Same labels and shapes in every shard; float32: the same values for every layer but the
    last. Reads labels and shapes only unless values are compared (full shards are gigabytes)."""
    names = sorted(os.listdir(os.path.join(root, "hf")))
    rows_ok, max_diff = True, 0.0
    for name in names:
        with safe_open(os.path.join(root, "steerable", name), "pt") as ours, \
                safe_open(os.path.join(root, "hf", name), "pt") as theirs:
            rows_ok &= all(torch.equal(ours.get_tensor(k), theirs.get_tensor(k))
                           for k in ("example", "position", "token_id"))
            for layer in layers[:-1]:
                key = f"layer.{layer}"
                rows_ok &= ours.get_slice(key).get_shape() == theirs.get_slice(key).get_shape()
                if exact and rows_ok:
                    diff = (ours.get_tensor(key).float() - theirs.get_tensor(key).float()).abs().max()
                    max_diff = max(max_diff, float(diff))
    return {"record": "check", "shards": len(names), "rows_ok": rows_ok, "values_checked": exact,
            "max_abs_diff": max_diff, "values_ok": not exact or max_diff < 1e-3}


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--shard-size", type=int, default=None, help="examples per shard (and per engine call)")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="where shards are written (default: /dev/shm)")
    p.add_argument("--keep", action="store_true", help="keep the shards")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side (medians compared)")
    args = p.parse_args(argv)
    path = common.setup("capture_corpus", args, {"shard_size": (64, 4), "hf_batch_size": (16, 2)})
    root = out_root(args, path)
    try:
        ours, dtype, layers, w = run_steerable(args, path, root)
        hf = run_hf(args, path, dtype, w, layers, root)
        check = compare(root, layers, exact=dtype == torch.float32)
        emit(check)
        emit({"record": "ratio", "prompt_tok_s_ratio": ours["prompt_tok_s"] / hf["prompt_tok_s"],
              "repeats": args.repeats, "steerable_median_s": ours["seconds"], "hf_median_s": hf["seconds"]})
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if not (check["rows_ok"] and check["values_ok"]):
        raise SystemExit("steerable's shards differ from HF's")

