"""How attention layers share the paged KV cache when some attend only within a sliding window.

There is one pool of physical blocks. A block holds ``block_size`` tokens of K and V for up to
``slots`` layers; the layers are split into *groups* of at most ``slots`` layers with the same
window, and every request has one block list per group (vLLM's hybrid allocator has the same
shape). A sliding-window group gives back the blocks that fall wholly before its window, so a long
context costs full-length memory only on full-attention layers and window-sized memory on the
rest, while all groups draw on the same free pool. A model without windows has one group holding
every layer: a block is then a token block of the whole model, as in a plain paged cache.

Neutral ground like ``steerable.step``: the driver's block manager and the worker's cache layout
both derive it from the model config, so they agree without talking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' sliding window (None: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: the layers whose KV its blocks hold, in slot order

    @classmethod
    def build(cls, layer_windows: Sequence[int | None]) -> KVGroups:
        """Layers grouped by window; a group is as large as the smallest set of same-window layers
        (so no slot is wasted there), and larger sets are split into groups of that size."""
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        if not by_window:
            raise ValueError("a model needs at least one attention layer")
        size = min(len(layers) for layers in by_window.values())
        windows, groups = [], []
        for window, layers in by_window.items():
            for start in range(0, len(layers), size):
                windows.append(window)
                groups.append(tuple(layers[start:start + size]))
        return cls(tuple(windows), tuple(groups))

    @classmethod
    def for_model(cls, cfg: Any) -> KVGroups:
        """From a ``ModelConfig`` (its ``attention_window`` of every layer)."""
        return cls.build([cfg.attention_window(layer) for layer in range(cfg.num_layers)])

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slots(self) -> int:
        """Layers per block: the KV tensor's layer dimension."""
        return max(len(layers) for layers in self.layers)

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, slot) of ``layer``'s KV."""
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} has no KV group")

    def stage_placement(self, layers: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """For the layers a worker holds (a pipeline stage's, or all): how many slots its blocks
        need, and each layer's (group, slot) among them. Every stage uses the same groups and block
        ids; a block on a stage holds only that stage's layers of the group."""
        used: dict[int, int] = {}
        placed = []
        for layer in layers:
            group = self.placement(layer)[0]
            placed.append((group, used.get(group, 0)))
            used[group] = used.get(group, 0) + 1
        return max(used.values()), placed

    def blocks_needed(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one sequence of ``num_tokens`` holds at most, computed ``max_chunk`` tokens a step:
        a windowed group holds the window before a chunk plus the chunk."""
        full = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            span = full if window is None else min(full, -(-(window - 1 + max_chunk) // block_size) + 1)
            total += span
        return total

    def max_tokens(self, num_blocks: int, block_size: int, max_chunk: int, limit: int) -> int:
        """The longest sequence (at most ``limit``) that ``num_blocks`` blocks hold on their own."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_needed(mid, block_size, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo
