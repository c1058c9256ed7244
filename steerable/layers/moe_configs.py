"""Tile configurations of the grouped MoE GEMMs, keyed by the number of tokens in a step.

A decode step of a large MoE reads every routed expert's weights once: its time is bytes over
bandwidth, so the tiles should be narrow enough to keep every SM loading and one row block per
expert (no expert read twice). A prefill chunk gives each expert hundreds of rows: there the MMA
sets the time and large tiles win. Neither is known without measuring, so ``python -m benchmarks
moe_tune`` times candidate tiles on a device for one shape and writes a table
(``moe_tables/<device>.json``, one entry per shape, one configuration per token count); a step
uses the entry whose token count is nearest its own. Shapes or devices without a table, and
float32 (whose results must not depend on the batch size), use ``DEFAULT``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TABLES = Path(__file__).parent / "moe_tables"


@dataclass(frozen=True)
class TileConfig:
    """One grouped GEMM's launch: output tile ``block_m x block_n`` (block_m is the layout's row
    block, shared by both GEMMs of a layer), ``block_k`` per step of the reduction, ``group_m`` row
    blocks walked per column block, and Triton's ``num_warps`` / ``num_stages``."""

    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def to_json(self) -> dict[str, int]:
        return asdict(self)


DEFAULT_BLOCK_M = 16  # about what one expert gets per decode step at batch 256 and k/E = 1/16
DEFAULT = (DEFAULT_BLOCK_M, TileConfig(), TileConfig())


def shape_key(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={intermediate},dtype={str(dtype).removeprefix('torch.')}"


def device_file(device_name: str) -> Path:
    return TABLES / (device_name.replace(" ", "_").replace("/", "_") + ".json")


def parse_entry(entry: dict) -> tuple[int, TileConfig, TileConfig]:
    """(block_m, gate-up tile, down tile) from one token count's JSON entry."""
    return int(entry["block_m"]), TileConfig(**entry["gate_up"]), TileConfig(**entry["down"])


@functools.cache
def _table(device_name: str, key: str) -> dict[int, tuple[int, TileConfig, TileConfig]]:
    path = device_file(device_name)
    if not path.exists():
        return {}
    entries = json.loads(path.read_text()).get(key, {})
    return {int(tokens): parse_entry(entry) for tokens, entry in entries.items()}


def tile_configs(num_tokens: int, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[int, TileConfig, TileConfig]:
    """(block_m, gate-up tile, down tile) for a step of ``num_tokens`` tokens."""
    if dtype == torch.float32 or device.type != "cuda":
        return DEFAULT
    table = _table(torch.cuda.get_device_name(device), shape_key(num_experts, hidden, intermediate, dtype))
    if not table:
        return DEFAULT
    return table[min(table, key=lambda tokens: (abs(tokens - num_tokens), tokens))]
