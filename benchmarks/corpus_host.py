"""Corpus capture's host side on its own (CPU, no model): a shard's fabricated step blocks through
the capture session's planning and delivery into a ``ShardBuffer`` (the copy ``capture_corpus``
makes of every row), the shard written by ``write_safetensors`` against ``save_file``, and shards
run as ``capture_corpus`` runs them (shard k written in the background while shard k + 1 is
delivered). Default sizes are the GPU benchmark's: Qwen3-0.6B's 28 layers x 1024, bf16, shards
of 64 prompts of 100-1024 tokens, every prompt row, steps of 8192 tokens.

    PYTHONPATH=. python benchmarks/corpus_host.py [--shards 4] [--out-dir /dev/shm] [--repeats 3]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import common
import numpy as np
import torch
from common import emit
from safetensors.torch import save_file
from tqdm.auto import tqdm

from steerable.capture.corpus import _ShardWriter
from steerable.capture.session import CaptureSession
from steerable.capture.shard_buffer import ShardBuffer
from steerable.capture.shard_file import write_safetensors
from steerable.hook_points import HIDDEN_STATES, HookLayout
from steerable.request import Request, ScheduledRequest
from steerable.sampling_params import SamplingParams

METADATA = {"format": "steerable-corpus-v1"}


def deliver_shard(session: CaptureSession, buffer: ShardBuffer, lens: list[int], block: torch.Tensor,
                  layers: list[int], budget: int, first: int) -> float:
    """Seconds spent in ``session.deliver`` for one shard whose prompts are prefilled first come,
    first served in steps of ``budget`` tokens; ``block`` stands for a step's host block."""
    prompts = [np.arange(n).tolist() for n in lens]
    buffer.reset(first, lens)
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


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--shards", type=int, default=None, help="shards in the pipelined run")
    p.add_argument("--repeats", type=int, default=None, help="single-shard measurements (fastest reported too)")
    p.add_argument("--out-dir", default=None, help="where shards are written (default: /dev/shm if present)")
    args = p.parse_args()
    common.setup("corpus_host", args, {"num_requests": (64, 4), "layers": (28, 2), "width": (1024, 64),
                                       "shards": (4, 2), "repeats": (3, 1)}, model=False)
    torch.set_num_threads(os.cpu_count() or 1)  # as an engine process on a GPU host runs
    base = args.out_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = Path(tempfile.mkdtemp(prefix="steerable-corpus-host-", dir=base))
    rng = np.random.default_rng(args.seed)
    layers = list(range(args.layers))
    session = CaptureSession(HookLayout.build(args.layers, args.width, 1, args.width), torch.bfloat16)
    block = torch.randn(args.layers, args.max_num_batched_tokens, args.width).to(torch.bfloat16)
    buffers = [ShardBuffer(args.layers, args.width, torch.bfloat16) for _ in range(2)]
    shard_lens = [rng.integers(args.min_len, args.max_len + 1, args.num_requests).tolist()
                  for _ in range(max(args.shards, 1))]
    gb = sum(shard_lens[0]) * args.layers * args.width * 2 / 1e9
    try:
        for repeat in range(args.repeats):
            seconds = deliver_shard(session, buffers[0], shard_lens[0], block, layers, args.max_num_batched_tokens, 0)
            emit({"record": "deliver", "repeat": repeat, "rows": sum(shard_lens[0]), "gb": gb, "seconds": seconds,
                  "gb_s": gb / seconds})
            tensors = buffers[0].tensors(layers)
            modes = ("write_safetensors", "save_file")
            for mode in modes if repeat % 2 == 0 else modes[::-1]:  # neither always writes into a fuller tmpfs
                path = root / f"{mode}.safetensors"
                t0 = time.perf_counter()
                if mode == "save_file":
                    save_file(tensors, path, metadata=METADATA)
                else:
                    write_safetensors(path, tensors, metadata=METADATA)
                seconds = time.perf_counter() - t0
                emit({"record": "write", "mode": mode, "repeat": repeat, "gb": gb, "seconds": seconds,
                      "gb_s": gb / seconds})
            same = (root / "write_safetensors.safetensors").read_bytes() == (root / "save_file.safetensors").read_bytes()
            for path in root.iterdir():
                path.unlink()
            if not same:
                raise SystemExit("write_safetensors wrote other bytes than save_file")
        index = {"shards": []}
        total_gb = sum(sum(lens) for lens in shard_lens) * args.layers * args.width * 2 / 1e9
        t0 = time.perf_counter()
        deliver_s = 0.0
        with _ShardWriter(root, index, tqdm(disable=True)) as writer:
            for k, lens in enumerate(shard_lens):
                buffer = buffers[k % 2]
                deliver_s += deliver_shard(session, buffer, lens, block, layers, args.max_num_batched_tokens,
                                           k * args.num_requests)
                writer.submit({"shard": k, "file": f"shard-{k:05d}.safetensors", "rows": buffer.rows},
                              buffer.tensors(layers))
        seconds = time.perf_counter() - t0
        emit({"record": "pipeline", "shards": len(shard_lens), "gb": total_gb, "seconds": seconds,
              "deliver_seconds": deliver_s, "gb_s": total_gb / seconds})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
