"""Where does a SAELens-cache step go on a GPU: the device's kernels, or the host's work (issue 46)?

``saelens_cache``'s workload (random windows of ``--context-size`` tokens, BOS first, one layer, the
writer into ``/dev/shm``) on one engine per ``--step-tokens`` setting (``max_num_batched_tokens``;
``max_num_seqs`` follows, windows per step), each after a warm-up:

- ``wall``: prefill (``generate``, ``max_tokens=1``) and the SAELens writer, alternated
  ``--repeats`` times;
- ``device``: one writer run under the torch profiler: the device kernels' summed time against the
  wall time (a fraction near 1 means the device is the bound; far below, the host), and the
  ``--top`` kernels by time;
- ``host``: one writer run under cProfile: the ``--top`` functions by their own time, every thread
  of the run's engine included (cProfile sees the calling thread only: the writer's and the
  sink's threads show as the engine's waits).

The capture run stops at the captured layer; at Qwen3-0.6B's shape on an H100 it took as long a
step as prefill through all 28 layers (2026-12-06/07). This probe's first run (1b8b952) found the
device 44-46 % busy, with as many windows in the engine as a step takes: the next step could only be
built once the one before had finished (``corpus_run.serial_steps_warning``). Engines here hold
twice a step's windows.

    python -m benchmarks saelens_split [--windows 8192] [--step-tokens 8192,32768]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import shutil
import tempfile
import time

import torch

from benchmarks import common
from benchmarks.common import emit, timed
from benchmarks.saelens_cache import make_windows


def device_profile(run, top: int) -> dict:
    """Wall time of ``run`` under the torch profiler, its device kernels' summed time and the largest."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        common.sync()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6
    return {"wall_s": wall, "kernel_s": kernel_s, "device_busy": kernel_s / wall,
            "top": [{"name": e.key[:120], "seconds": e.self_device_time_total / 1e6, "calls": e.count}
                    for e in kernels[:top]]}


def host_profile(run, top: int) -> dict:
    """Wall time of ``run`` under cProfile and its ``top`` functions by their own time."""
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(run)
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    rows = sorted(((own, calls, f"{func[2]} ({func[0].rsplit('/', 1)[-1]}:{func[1]})")
                   for func, (_, calls, own, _, _) in stats.items()), reverse=True)[:top]
    return {"wall_s": wall, "top": [{"function": name, "own_s": own, "calls": calls} for own, calls, name in rows]}


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=None, help="windows per run (default: 8192)")
    p.add_argument("--context-size", type=int, default=None, help="tokens per window (default: 128)")
    p.add_argument("--step-tokens", default=None, help="comma-separated max_num_batched_tokens (default: 8192,32768)")
    p.add_argument("--store-dtype", default="float16", choices=["float32", "float16"])
    p.add_argument("--repeats", type=int, default=None, help="alternated wall runs of each side (default: 2)")
    p.add_argument("--top", type=int, default=15, help="kernels and host functions listed")
    args = p.parse_args(argv)
    path = common.setup("saelens_split", args, {"windows": (8192, 12), "context_size": (128, 16),
                                                "step_tokens": ("8192,32768", "32,64"), "repeats": (2, 1)})
    from transformers import AutoConfig

    from steerable import SamplingParams, capture_corpus

    config = AutoConfig.from_pretrained(path)
    layer = config.num_hidden_layers // 2
    windows = make_windows(args, config.vocab_size, config.bos_token_id or 0)
    prompts = windows.tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    root = tempfile.mkdtemp(prefix="steerable-split-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for step_tokens in [int(x) for x in args.step_tokens.split(",")]:
            seqs = max(1, step_tokens // args.context_size)
            # Twice a step's windows in the engine: the next step is built while the device runs one.
            llm = common.make_llm(args, path, enable_prefix_caching=False, max_num_batched_tokens=step_tokens,
                                  max_num_seqs=2 * seqs)

            def prefill(count: int = len(prompts)) -> None:
                llm.generate(prompts[:count], params, use_tqdm=False)

            def saelens(count: int = len(windows)) -> None:
                out = tempfile.mkdtemp(dir=root)
                capture_corpus(llm, windows[:count], out, format="saelens", context_size=args.context_size,
                               layers=[layer], dtype=args.store_dtype, batch_size=2 * seqs)
                shutil.rmtree(out)

            prefill(2 * seqs)
            saelens(2 * seqs)
            for repeat in range(args.repeats):
                for mode, run in (("prefill", prefill), ("saelens", saelens)):
                    _, seconds = timed(run)
                    emit({"record": "wall", "step_tokens": step_tokens, "mode": mode, "repeat": repeat,
                          "seconds": seconds, "tok_s": windows.size / seconds})
            emit({"record": "device", "step_tokens": step_tokens, "mode": "saelens",
                  **device_profile(saelens, args.top)})
            emit({"record": "host", "step_tokens": step_tokens, "mode": "saelens", **host_profile(saelens, args.top)})
            llm.shutdown()
            common.free_cuda()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
