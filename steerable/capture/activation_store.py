"""The activation store: captured prompt rows of whole KV blocks, kept on the host under the
block's prefix-cache hash, so a later request that hits the block in the prefix cache gets the
rows it captures there without recomputing them (``LLM(activation_store_bytes=N)``).

A block's hash (``engine.kv_cache.hash_block``) chains every token before and inside it with what
else shaped its KV: the cache salt and the identity of every steering intervention that touches a
prompt row at or before it. The same things shape every activation of those positions at every
layer, so the rows of a block at one hook point are a function of its hash, the layer, the hook and
the stored dtype (and, for SAE features, the SAE registration and top-k): that is the key. A
steered prefix and an unsteered one never share an entry, as they never share a KV block.

Entries are filled when capture delivers every row of a whole prompt block at some layers (a chunk
that ends inside a block, or a capture that selected only some of its rows, stores nothing for
it), and a request is served whole blocks only, from the first row it needs, as far as every layer
it captures is stored; from there on it recomputes, and the prefix-cache hit stops there. Least
recently used entries go first when ``capacity`` bytes are exceeded; an entry larger than the
whole budget is not kept. Only the driver holds the store: workers receive plans without the
served rows, which are delivered with the step that starts the request's computation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# (hook point, stored dtype, SAE worker key or None, top-k): what a block's rows were captured as.
Kind = tuple[str, torch.dtype, "str | None", int]


@dataclass
class StoredRows:
    """Rows served from the store for one destination, cut from stored blocks only when they are
    copied (once, into the request's block when it finishes, or a stream's): ``count`` rows
    starting ``start`` rows into the first of ``blocks`` (a run of consecutive rows), or the rows
    at ``picks`` (indices into the blocks' rows laid end to end)."""

    blocks: list[dict[int, np.ndarray]]  # stored entries, layer -> [block_size, width]
    layers: list[int]
    start: int
    count: int
    picks: np.ndarray | None = None

    def copy_into(self, out: np.ndarray) -> None:
        """Write the rows into ``out`` ``[layers, count, width]``."""
        for layer_out, layer in zip(out, self.layers):
            arrays = [block[layer] for block in self.blocks]
            if self.picks is not None:
                np.take(np.concatenate(arrays), self.picks, axis=0, out=layer_out)
                continue
            size = len(arrays[0])
            end = self.start + self.count - (len(arrays) - 1) * size  # rows taken of the last block
            arrays[-1] = arrays[-1][:end]
            arrays[0] = arrays[0][self.start:]
            np.concatenate(arrays, out=layer_out)

    @property
    def sample(self) -> np.ndarray:
        """A stored block (its dtype and width are the rows')."""
        return self.blocks[0][self.layers[0]]


class ActivationStore:
    """Per (block hash, kind): every stored layer's rows ``[block_size, width]`` (host numpy, 16-bit
    floats as their bits), in least-recently-used order, within ``capacity`` bytes."""

    def __init__(self, capacity: int, block_size: int):
        self.capacity = capacity
        self.block_size = block_size
        self.entries: OrderedDict[tuple[bytes, Kind], dict[int, np.ndarray]] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # blocks served to a capture destination
        self.misses = 0  # blocks a destination found in the prefix cache but not here: recomputed
        self.evictions = 0

    def has(self, block_hash: bytes, kind: Kind, layers: Sequence[int] | set[int]) -> bool:
        entry = self.entries.get((block_hash, kind))
        return entry is not None and entry.keys() >= set(layers)

    def take_run(self, hashes: Sequence[bytes], first: int, end: int, kind: Kind,
                 layers: Sequence[int]) -> list[dict[int, np.ndarray]]:
        """The entries of blocks ``first``, ``first + 1``, ... (below ``end``) that hold every one of
        ``layers``, up to the first that does not; they become the most recently used."""
        need, entries, run = set(layers), self.entries, []
        for block in range(first, end):
            key = (hashes[block], kind)
            entry = entries.get(key)
            if entry is None or not entry.keys() >= need:
                break
            entries.move_to_end(key)
            run.append(entry)
        return run

    def put(self, block_hash: bytes, kind: Kind, rows: dict[int, np.ndarray]) -> None:
        """Keep ``rows`` (layer -> the block's rows, owned by the store from now on) beside the
        layers already stored for the block, then evict the least recently used entries until
        the store fits its budget again."""
        key = (block_hash, kind)
        entry = self.entries.setdefault(key, {})
        self.entries.move_to_end(key)
        for layer, block in rows.items():
            if layer not in entry:
                entry[layer] = block
                self.bytes += block.nbytes
        while self.bytes > self.capacity and self.entries:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= sum(block.nbytes for block in evicted.values())
            self.evictions += 1

    def stats(self) -> dict[str, int]:
        return {"activation_store_hits": self.hits, "activation_store_misses": self.misses,
                "activation_store_bytes": self.bytes, "activation_store_blocks": len(self.entries),
                "activation_store_evictions": self.evictions}


def empty_stats() -> dict[str, int]:
    """The counters of an engine without a store."""
    return ActivationStore(0, 1).stats()
