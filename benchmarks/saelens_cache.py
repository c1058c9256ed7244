"""SAELens activation cache of one layer, against the engine's own prefill and HF ``output_hidden_states``.

Issue 46, DESIGN.md §6: prompt tokens/s of ``capture_corpus(..., format="saelens")`` writing one
layer's activations for windows of 128 tokens, against the engine's own prefill of the same windows
with no capture (target >= 80 %) and HF ``output_hidden_states`` at its best batch size on the same
windows (target >= 3x), all in one run.

The windows are random token ids (BOS first, seeded), 128 tokens each by default. The prefill
baseline is ``LLM.generate`` of every window with ``max_tokens=1`` (what a capture run computes, no
capture stream); prefix caching is off for both, so neither reuses the other's KV. The HF baseline
runs the base model with ``output_hidden_states=True`` batch by batch and copies the layer's
activations to the host in the stored dtype (the least a cache writer does; nothing is written to
disk), over several batch sizes; the best one counts. ``--repeats`` alternates prefill and
capture runs and compares medians. Records: ``prefill``, ``saelens`` (with the run's stats),
``hf`` (one per batch size), ``check`` (the dataset's shape and token ids) and ``ratio``.

    python -m benchmarks saelens_cache [--windows 4096] [--layer 14] [--store-dtype float32]
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import torch

from . import common
from .common import emit, timed


def storage_root(args, tokens: int, width: int) -> str:
    """RAM (/dev/shm) when it holds two runs' files, so the run measures capture, not the disk."""
    base = args.out_dir
    itemsize = 4 if args.store_dtype == "float32" else 2
    if base is None and os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 3 * tokens * width * itemsize:
        base = "/dev/shm"
    root = tempfile.mkdtemp(prefix="steerable-saelens-", dir=base)
    emit({"record": "storage", "dir": root, "free_gb": shutil.disk_usage(root).free / 1e9})
    return root


def make_windows(args, vocab: int, bos: int) -> np.ndarray:
    rng = np.random.default_rng(args.seed)
    windows = rng.integers(0, vocab, (args.windows, args.context_size), dtype=np.int64)
    windows[:, 0] = bos
    return windows


def run_steerable(args, path: str, windows: np.ndarray, layer: int, root: str) -> tuple[dict, dict, torch.dtype]:
    from steerable import SamplingParams, capture_corpus

    llm = common.make_llm(args, path, enable_prefix_caching=False)
    prompts = windows.tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tokens = windows.size
    runs: dict[str, list[dict]] = {"prefill": [], "saelens": []}

    def run(mode: str, salt: str, warm: bool = False) -> None:
        count = min(len(windows), 2 * args.max_num_seqs) if warm else len(windows)
        if mode == "prefill":
            _, seconds = timed(lambda: llm.generate(prompts[:count], params, use_tqdm=False))
            record = {"record": "prefill", "seconds": seconds, "tokens": count * args.context_size,
                      "tok_s": count * args.context_size / seconds}
        else:
            out = os.path.join(root, salt)
            index, seconds = timed(lambda: capture_corpus(llm, windows[:count], out, format="saelens",
                                                          context_size=args.context_size, layers=[layer],
                                                          dtype=args.store_dtype, batch_size=args.max_num_seqs))
            written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
            record = {"record": "saelens", "seconds": seconds, "tokens": count * args.context_size,
                      "tok_s": count * args.context_size / seconds, "files": len(index["shards"]),
                      "gb_written": written / 1e9, "gb_s": written / 1e9 / seconds, "stats": index["stats"]}
            if warm or salt != f"saelens-{args.repeats - 1}":
                shutil.rmtree(out)
        if not warm:
            runs[mode].append(record)
            emit({**record, "repeat": len(runs[mode]) - 1})

    common.interleaved(["prefill", "saelens"], run, args.repeats)
    assert all(r["tokens"] == tokens for r in runs["saelens"])
    dtype = llm.engine.dtype
    llm.shutdown()  # the HF baseline needs the GPU memory the model and KV cache held
    common.free_cuda()
    return median_run(runs["prefill"]), median_run(runs["saelens"]), dtype


def run_hf(args, path: str, windows: np.ndarray, layer: int, dtype: torch.dtype) -> dict:
    """HF at each batch size: the base model's hidden states, the layer's rows to the host."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    store = {"float32": torch.float32, "float16": torch.float16}[args.store_dtype]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval().model
    ids = torch.from_numpy(windows)
    best = None
    with torch.inference_mode():
        base(input_ids=ids[:2].to(device), output_hidden_states=True)  # warm-up
        for batch in [int(b) for b in args.hf_batch_sizes.split(",")]:
            def run() -> None:
                for lo in range(0, len(ids), batch):
                    hidden = base(input_ids=ids[lo:lo + batch].to(device), output_hidden_states=True,
                                  use_cache=False).hidden_states[layer + 1]
                    hidden.to(store).cpu()
            try:
                _, seconds = timed(run)
            except torch.OutOfMemoryError:
                common.free_cuda()
                emit({"record": "hf", "batch_size": batch, "oom": True})
                break
            record = {"record": "hf", "batch_size": batch, "seconds": seconds, "tokens": ids.numel(),
                      "tok_s": ids.numel() / seconds}
            emit(record)
            best = record if best is None or record["tok_s"] > best["tok_s"] else best
    return best


def check(root: str, args, windows: np.ndarray, layer: int) -> dict:
    """The kept dataset: one column of [N, hidden] per window plus the windows' token ids, in order."""
    import pyarrow as pa

    out = os.path.join(root, f"saelens-{args.repeats - 1}")
    names = sorted(n for n in os.listdir(out) if n.startswith("data-"))
    tokens, rows = [], 0
    for name in names:
        with pa.memory_map(os.path.join(out, name)) as source:
            table = pa.ipc.open_stream(source).read_all()
        rows += table.num_rows
        tokens.append(table.column("token_ids").combine_chunks().flatten().to_numpy())
        column = f"blocks.{layer}.hook_resid_post"
        assert table.column_names == [column, "token_ids"], table.column_names
    ok = rows == len(windows) and np.array_equal(np.concatenate(tokens), windows.reshape(-1))
    return {"record": "check", "files": len(names), "rows": rows, "token_ids_ok": bool(ok),
            "has_state": os.path.exists(os.path.join(out, "state.json"))}


def median_run(results: list[dict]) -> dict:
    return sorted(results, key=lambda r: r["seconds"])[(len(results) - 1) // 2]


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=None, help="windows captured (default: 4096)")
    p.add_argument("--context-size", type=int, default=None, help="tokens per window (default: 128)")
    p.add_argument("--layer", type=int, default=None, help="the captured layer (default: the middle one)")
    p.add_argument("--store-dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--hf-batch-sizes", default=None, help="comma-separated (default: 16,32,64,128,256)")
    p.add_argument("--repeats", type=int, default=None, help="alternating runs of each side (default: 3)")
    p.add_argument("--out-dir", default=None, help="where the cache is written (default: /dev/shm)")
    args = p.parse_args(argv)
    path = common.setup("saelens_cache", args, {"windows": (4096, 12), "context_size": (128, 16),
                                                "hf_batch_sizes": ("16,32,64,128,256", "2,4"), "repeats": (3, 1)})
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    layer = config.num_hidden_layers // 2 if args.layer is None else args.layer
    windows = make_windows(args, config.vocab_size, config.bos_token_id or 0)
    root = storage_root(args, windows.size, config.hidden_size)
    try:
        prefill, ours, dtype = run_steerable(args, path, windows, layer, root)
        verdict = check(root, args, windows, layer)
        emit(verdict)
        hf = run_hf(args, path, windows, layer, dtype)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit({"record": "ratio", "layer": layer, "context_size": args.context_size, "windows": args.windows,
          "store_dtype": args.store_dtype, "model_dtype": str(dtype).removeprefix("torch."),
          "saelens_tok_s": ours["tok_s"], "prefill_tok_s": prefill["tok_s"], "hf_best_tok_s": hf["tok_s"],
          "hf_best_batch_size": hf["batch_size"], "of_prefill": ours["tok_s"] / prefill["tok_s"],
          "over_hf": ours["tok_s"] / hf["tok_s"], "targets": {"of_prefill": 0.8, "over_hf": 3.0}})
    if not (verdict["token_ids_ok"] and verdict["has_state"]):
        raise SystemExit("the SAELens cache is not what was asked for")


if __name__ == "__main__":
    main()
