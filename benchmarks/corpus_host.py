"""Corpus capture's host side on a CPU: delivery into the mapped shard file against ``save_file``.

Corpus capture's host side on its own (CPU, no model): a shard's fabricated step blocks through
the capture session's planning and delivery into a ``ShardBuffer`` over the shard's mapped file
(``ShardFile``: the one copy ``capture_corpus`` makes of every row, and all of its writing),
against delivery into plain memory followed by ``save_file`` (what writing the file at the end
costs). Default sizes are the GPU benchmark's: Qwen3-0.6B's 28 layers x 1024, bf16, shards of 64
prompts of 100-1024 tokens, every prompt row, steps of 8192 tokens. The two files' tensors must
be equal (exit non-zero otherwise). Then how fast a file of that size fills on the file system
itself: ``pwrite`` from memory by 1 and by ``--write-threads`` threads (one file's writes share
its inode lock), against ``posix_fallocate`` and a copy into the mapped pages (``ShardFile``).

    python -m benchmarks corpus_host [--out-dir /dev/shm] [--repeats 3]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from steerable.capture.session import CaptureSession
from steerable.capture.shard_buffer import ShardBuffer
from steerable.capture.shard_file import LABELS, ShardFile
from steerable.hook_points import HIDDEN_STATES, HookLayout
from steerable.request import Request, ScheduledRequest
from steerable.sampling_params import SamplingParams

from . import common
from .common import emit

METADATA = {"format": "steerable-corpus-v1"}


def deliver_shard(session: CaptureSession, buffer: ShardBuffer, lens: list[int], block: torch.Tensor,
                  layers: list[int], budget: int, first: int) -> float:
    """Seconds spent in ``session.deliver`` for one shard whose prompts are prefilled first come,
    first served in steps of ``budget`` tokens; ``block`` stands for a step's host block."""
    prompts = [np.arange(n).tolist() for n in lens]
    session.start(HIDDEN_STATES, layers, "bfloat16", "all", "all_prompt", None, sink=buffer)
    queue = []
    for i, prompt in enumerate(prompts):
        request = Request(f"corpus-{first + i}-{i:08x}", f"corpus-{first + i}", None, prompt,
                          SamplingParams(max_tokens=1), 0, [])
        session.admit(request)
        buffer.expect(request.request_id, first + i)
        queue.append(request)
    seconds = 0.0
    while queue:
        scheduled, left = [], budget
        for request in queue:
            n = min(left, request.num_prompt_tokens - request.num_computed_tokens)
            if n == 0:
                break
            scheduled.append(ScheduledRequest(request, n, request.num_computed_tokens + n == request.num_prompt_tokens))
            left -= n
        positions = np.concatenate([np.arange(s.request.num_computed_tokens, s.request.num_computed_tokens + s.num_tokens)
                                    for s in scheduled])
        query_start = np.concatenate([[0], np.cumsum([s.num_tokens for s in scheduled])])
        plan, delivery = session.plan(scheduled, positions, positions.copy(), query_start)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_tokens
            s.request.max_computed_tokens = s.request.num_computed_tokens
        t0 = time.perf_counter()
        session.deliver(delivery, [block[:, :len(g.rows)] for g in plan.groups], False)
        seconds += time.perf_counter() - t0
        for s in scheduled:
            if s.samples:
                session.finish(s.request)
                queue.remove(s.request)
    session.stop(HIDDEN_STATES)
    buffer.check_complete()
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out-dir", default=None, help="where shards are written (default: /dev/shm if present)")
    p.add_argument("--write-threads", type=int, default=8)
    args = p.parse_args(argv)
    common.setup("corpus_host", args, {"num_requests": (64, 4), "layers": (28, 2), "width": (1024, 64),
                                       "repeats": (3, 1)}, model=False)
    torch.set_num_threads(os.cpu_count() or 1)  # as an engine process on a GPU host runs
    base = args.out_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = Path(tempfile.mkdtemp(prefix="steerable-corpus-host-", dir=base))
    layers = list(range(args.layers))
    session = CaptureSession(HookLayout.build(args.layers, args.width, 1, args.width), torch.bfloat16)
    block = torch.randn(args.layers, args.max_num_batched_tokens, args.width).to(torch.bfloat16)
    lens = np.random.default_rng(args.seed).integers(args.min_len, args.max_len + 1, args.num_requests).tolist()
    rows = sum(lens)
    gb = rows * args.layers * args.width * 2 / 1e9
    deliver = lambda buffer: deliver_shard(session, buffer, lens, block, layers,  # noqa: E731
                                           args.max_num_batched_tokens, 0)
    try:
        for repeat in range(args.repeats):
            modes = ("mapped", "memory_then_save_file")
            for mode in modes if repeat % 2 == 0 else modes[::-1]:  # neither always writes into a fuller tmpfs
                path = root / f"{mode}.safetensors"
                t0 = time.perf_counter()
                if mode == "mapped":
                    shard = ShardFile(path, layers, rows, args.width, torch.bfloat16, METADATA)
                    shard.allocate()  # capture_corpus does this in a background thread, ahead of the rows
                    allocate_s = time.perf_counter() - t0
                    deliver_s = deliver(ShardBuffer(0, lens, shard.data, shard.labels, shard.wait_rows))
                    del shard
                    write_s = 0.0
                else:
                    data, labels = torch.empty(args.layers, rows, args.width, dtype=torch.bfloat16), \
                        np.empty((3, rows), np.int64)
                    allocate_s = time.perf_counter() - t0
                    deliver_s = deliver(ShardBuffer(0, lens, data, labels))
                    t1 = time.perf_counter()
                    tensors = {f"layer.{layer}": data[i] for i, layer in enumerate(layers)}
                    tensors.update({name: torch.from_numpy(labels[j]) for j, name in enumerate(LABELS)})
                    save_file(tensors, path, metadata=METADATA)
                    write_s = time.perf_counter() - t1
                    del data, labels, tensors
                seconds = time.perf_counter() - t0
                emit({"record": "shard", "mode": mode, "repeat": repeat, "rows": rows, "gb": gb, "seconds": seconds,
                      "allocate_seconds": allocate_s, "deliver_seconds": deliver_s, "write_seconds": write_s,
                      "gb_s": gb / seconds})
            same = same_tensors(root / "mapped.safetensors", root / "memory_then_save_file.safetensors")
            for path in root.iterdir():
                path.unlink()
            if not same:
                raise SystemExit("the mapped shard differs from save_file's")
        file_rates(root, torch.randn(args.layers, rows, args.width).to(torch.bfloat16), args.write_threads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def file_rates(root: Path, data: torch.Tensor, threads: int) -> None:
    """One file of ``data``'s bytes, fresh each time: written by ``pwrite`` in 64 MiB slices from
    1 and from ``threads`` threads, then reserved and filled through its mapping."""
    view = memoryview(data.view(-1).view(torch.uint8).numpy())
    gb = len(view) / 1e9
    for n in sorted({1, threads}):
        path = root / f"pwrite-{n}"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda at: write_at(fd, view[at:at + (64 << 20)], at), range(0, len(view), 64 << 20)))
        os.close(fd)
        seconds = time.perf_counter() - t0
        emit({"record": "file", "mode": "pwrite", "threads": n, "gb": gb, "seconds": seconds, "gb_s": gb / seconds})
        path.unlink()
    layers, rows, width = data.shape
    t0 = time.perf_counter()
    shard = ShardFile(root / "mapped", list(range(layers)), rows, width, data.dtype)
    shard.allocate()
    t1 = time.perf_counter()
    shard.data.copy_(data)
    t2 = time.perf_counter()
    emit({"record": "file", "mode": "fallocate_then_mapped_copy", "threads": torch.get_num_threads(), "gb": gb,
          "seconds": t2 - t0, "allocate_seconds": t1 - t0, "copy_seconds": t2 - t1, "gb_s": gb / (t2 - t0)})
    del shard
    (root / "mapped").unlink()


def write_at(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def same_tensors(a: Path, b: Path) -> bool:
    with safe_open(a, "pt") as x, safe_open(b, "pt") as y:
        return x.metadata() == y.metadata() and set(x.keys()) == set(y.keys()) and \
            all(torch.equal(x.get_tensor(k), y.get_tensor(k)) for k in x.keys())

