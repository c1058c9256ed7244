"""Which launch configuration of the paged-attention kernel is fastest over a workload's decode steps?

Decode attention of throughput.py's workload, replayed call by call: for every ``--stride``-th
decode step, the requests still decoding (output length not reached) with their context lengths at
that step, the paged-attention kernel timed under each launch configuration, and its output compared
with the shipped configuration's. Seconds over the whole workload (each sampled step counts
``stride`` steps of every layer; a sliding-window layer is timed with its window), by decode batch
size, beside the time the K and V bytes those steps read take at the card's copy speed
(``bound_seconds``, ``fraction_of_bound``), for a bf16 and a float8 cache (V position-major, as the
engine lays a float8 cache out on a GPU). This is how the decode tile was chosen: a kernel sweep at
one batch size and context length misses the shrinking batches and long contexts of the workload's tail.
A configuration changes the fields of the config the shape's head size takes (``CONFIG`` up to
128-wide heads, ``CONFIG_WIDE`` above).

    python -m benchmarks attention_replay [--stride 8]
    --smoke: tiny shapes under Triton's CPU interpreter (TRITON_INTERPRET=1
    STEERABLE_FUSED_ON_CPU=1), wall-clock timed: checks the script, not the kernel's speed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
import triton

from steerable.layers.attention import value_cache_view
from steerable.layers.attention_backends import triton_paged as tp

from .. import common
from ..common import emit, timed

BLOCK_SIZE = 16  # the engine's


def attention_shape(shape: str) -> dict:
    """``--shape``'s attention, from the config common.py builds the model with: layers, query and
    KV heads, head size, the score scale, Gemma 2's soft-cap and each layer's window (None: global)."""
    config_name, config, _ = common.SHAPES[shape]
    if "head_dim" not in config:
        raise SystemExit(f"attention_replay needs a shape with head_dim in its config, not {shape}")
    hf = common._config(config_name, config)
    types = getattr(hf, "layer_types", None) or ["full_attention"] * config["num_hidden_layers"]
    windows = [hf.sliding_window if kind == "sliding_attention" else None for kind in types]
    return dict(layers=config["num_hidden_layers"], q_heads=config["num_attention_heads"],
                kv_heads=config["num_key_value_heads"], head_size=config["head_dim"], block_size=BLOCK_SIZE,
                scale=config.get("query_pre_attn_scalar", config["head_dim"]) ** -0.5,
                softcap=config.get("attn_logit_softcapping"), windows=windows)


SMOKE_SHAPE = dict(layers=2, q_heads=4, kv_heads=2, head_size=16, block_size=4, scale=0.25, softcap=None,
                   windows=[8, None])
# name -> fields changed from the shipped defaults (the baseline, "shipped").
CONFIGS = {"shipped": {}, "decode_tile_64": {"decode_tile_n": 64}, "decode_tile_256": {"decode_tile_n": 256},
           "split_kv_to_512_programs": {"split_kv_max_programs": 512},
           "decode_tile_32": {"decode_tile_n": 32}, "decode_tile_64_w8": {"decode_tile_n": 64, "decode_num_warps": 8},
           "decode_tile_128": {"decode_tile_n": 128},
           "decode_tile_128_w8": {"decode_tile_n": 128, "decode_num_warps": 8},
           "decode_tile_64_s3": {"decode_tile_n": 64, "decode_num_stages": 3},
           "decode_tile_32_s3": {"decode_tile_n": 32, "decode_num_stages": 3},
           "decode_tile_64_s1": {"decode_tile_n": 64, "decode_num_stages": 1},
           # From 5 stages Triton double-buffers a program's K and V tiles (gemma2_decode.py's CANDIDATES say why).
           "decode_tile_128_s5": {"decode_tile_n": 128, "decode_num_stages": 5},
           "decode_tile_64_s5": {"decode_tile_n": 64, "decode_num_stages": 5},
           "decode_tile_32_s5": {"decode_tile_n": 32, "decode_num_stages": 5}}
# The smoke batches are small enough for the split-KV path; the other configs take the unified kernel.
SMOKE_CONFIGS = {"shipped": {}, "unified_tile_16": {"split_kv_max_programs": 0, "decode_tile_n": 16},
                 "split_target_8": {"split_kv_max_programs": 64, "split_kv_target_programs": 8, "split_tile_n": 4}}
BUCKETS = (16, 32, 64, 128)


def bucket(batch: int) -> str:
    return next((f"batch<={b}" for b in BUCKETS if batch <= b), f"batch>{BUCKETS[-1]}")


def caches(num_blocks: int, shape: dict, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V laid out as the engine lays them out (a float8 V position-major on a GPU)."""
    block = (shape["block_size"], shape["kv_heads"], shape["head_size"])
    k, v = torch.randn(2, num_blocks * math.prod(block), device=device).to(dtype)
    return k.view(num_blocks, *block), value_cache_view(v, num_blocks, *block)


def kernel_seconds(cuda: bool) -> Callable[[Callable[[], None]], float]:
    """Seconds of one call: ``do_bench`` on a GPU, the wall clock on a CPU (smoke runs only)."""
    if cuda:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=3, rep=15) / 1e3
    return lambda fn: timed(fn)[1]


def layer_windows(shape: dict, longest: int) -> dict[int | None, int]:
    """Layers per window (None: global); a window no context of the workload reaches is global."""
    counts: dict[int | None, int] = {}
    for window in shape["windows"]:
        key = window if window is not None and window < longest else None
        counts[key] = counts.get(key, 0) + 1
    return counts


def replay(shape: dict, configs: dict[str, dict], w: common.Workload, args, dtype: torch.dtype,
           model_dtype: torch.dtype, device: str, speed: float) -> Iterator[dict]:
    """One ``config`` record per configuration: the workload's decode attention (every
    ``args.stride``-th step) timed under it, against the shipped configuration's output and against
    the time its K and V bytes take at ``speed`` (a copy's bytes, read + write, per second: as
    throughput.py's roofline counts). A configuration the card cannot build gets an ``error``."""
    cuda = device == "cuda"
    seconds = kernel_seconds(cuda)
    input_lens, output_lens = np.array(w.input_lens), np.array(w.output_lens)
    bs = shape["block_size"]
    blocks_per_seq = -(-(args.max_len * 2) // bs)
    gen = torch.Generator().manual_seed(args.seed)
    block_tables = torch.randperm(len(w) * blocks_per_seq, generator=gen).view(len(w), -1).to(torch.int32).to(device)
    config = tp.config_for(shape["head_size"])
    shipped = dataclasses.asdict(config)
    workspace = tp.DecodeWorkspace(len(w), shape["q_heads"], shape["head_size"], device)
    windows = layer_windows(shape, int((input_lens + output_lens).max()))
    position_bytes = 2 * shape["kv_heads"] * shape["head_size"] * dtype.itemsize  # K and V of one position
    k_cache, v_cache = caches(block_tables.numel(), shape, dtype, device)
    shipped_out: dict[tuple[int, int | None], torch.Tensor] = {}  # each step's output under the shipped config
    totals: dict[str, float] = {}

    def time_config() -> tuple[dict[str, float], float, float]:
        """(seconds by batch bucket, the bytes' seconds at copy speed, largest difference from the
        shipped config's output) of the sampled steps under the config as it is set now."""
        by_bucket: dict[str, float] = {}
        bound = 0.0
        max_abs_diff = 0.0
        for step in range(1, int(output_lens.max()), args.stride):
            active = np.nonzero(output_lens > step)[0]
            lens = input_lens[active] + step
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            q = torch.randn(len(active), shape["q_heads"], shape["head_size"],
                            generator=torch.Generator().manual_seed(step)).to(device, model_dtype)
            out = torch.empty_like(q)
            starts = torch.arange(len(active) + 1, dtype=torch.int32, device=device)
            table = block_tables[torch.from_numpy(active).to(device)]
            key = bucket(len(active))
            for window, layers in windows.items():
                def attend() -> None:
                    tp.paged_attention(q, k_cache, v_cache, out, starts, seq_lens, table, 1, shape["scale"],
                                       sliding_window=window, workspace=workspace, softcap=shape["softcap"])

                attend()
                reference = shipped_out.setdefault((step, window), out.clone())
                max_abs_diff = max(max_abs_diff, (out.float() - reference.float()).abs().max().item())
                by_bucket[key] = by_bucket.get(key, 0.0) + seconds(attend) * args.stride * layers
                visible = np.minimum(lens, window) if window else lens
                bound += int(visible.sum()) * position_bytes / speed * args.stride * layers
        return by_bucket, bound, max_abs_diff

    try:
        for name, changes in configs.items():
            for field, value in {**shipped, **changes}.items():
                setattr(config, field, value)
            try:
                by_bucket, bound, max_abs_diff = time_config()
            except triton.runtime.errors.OutOfResources as error:  # a tile the card's shared memory does not hold
                yield {"record": "config", "config": name, "changes": changes,
                       "kv_dtype": str(dtype).removeprefix("torch."), "error": str(error)}
                continue
            totals[name] = sum(by_bucket.values())
            yield {"record": "config", "config": name, "changes": changes,
                   "kv_dtype": str(dtype).removeprefix("torch."), "seconds": totals[name], "by_batch": by_bucket,
                   "bound_seconds": bound, "fraction_of_bound": bound / totals[name],
                   "vs_shipped": totals[name] / totals["shipped"], "max_abs_diff_vs_shipped": max_abs_diff}
    finally:
        for field, value in shipped.items():
            setattr(config, field, value)


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--stride", type=int, default=8, help="time every stride-th decode step")
    p.add_argument("--configs", default=None, help="comma-separated names of CONFIGS to time (default: all)")
    p.add_argument("--model-dtype-only", action="store_true", help="skip the float8 cache")
    args = p.parse_args(argv)
    common.setup("attention_replay", args, model=False)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("attention_replay times GPU kernels: run it on a CUDA machine (or --smoke on a CPU)")
    shape = SMOKE_SHAPE if args.smoke else attention_shape(args.shape)
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    if args.configs:
        names = ["shipped", *(n for n in args.configs.split(",") if n != "shipped")]
        unknown = set(names) - set(configs)
        if unknown:
            raise SystemExit(f"unknown configs {sorted(unknown)}; expected some of {sorted(configs)}")
        configs = {n: configs[n] for n in names}
    device, model_dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    speed = common.copy_speed(torch.device(device))
    w = common.workload(args.num_requests, args.seed, args.min_len, args.max_len)
    for dtype in (model_dtype,) if args.model_dtype_only else (model_dtype, torch.float8_e4m3fn):
        for record in replay(shape, configs, w, args, dtype, model_dtype, device, speed):
            emit(record)
