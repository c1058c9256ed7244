"""The capture plane's side of the activation store (``activation_store``): how far a request's
prefix-cache hit may go given the prompt rows its destinations need, the rows the store serves for
the part of the hit they need, and the whole prompt blocks capture computed, kept for later.

The scheduler first finds the KV hit, then asks ``cover`` per destination: a destination that
needs prompt rows below the hit lets it stand as far as the store holds whole blocks of those rows
at each of its layers, from the first block it needs; the hit stops at the first row it needs
beyond that. When the request is planned, the rows between its high-water mark (rows below it were
delivered before a preemption) and the hit come from the store, delivered with that step's rows:
exactly once, labelled as computed rows are, never to a request that finished meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from steerable.capture.activation_store import ActivationStore, Kind, StoredRows
from steerable.capture.planner import Destination, PlannedGroup, RowSelector
from steerable.hook_points import ATTENTION_PATTERNS
from steerable.request import Request, ScheduledRequest


@dataclass
class _Cover:
    """One destination's lookup at the request's last scheduling."""

    destination: Destination
    selector: RowSelector
    first_block: int  # the block of the first prompt row it needs
    end_block: int  # the store holds every block from first_block to here
    hit_blocks: int  # blocks the prefix cache held
    entries: list[dict[int, np.ndarray]]  # those blocks' entries, first_block onwards
    kind: Kind


@dataclass
class ServedRows:
    """Prompt rows a destination takes from the store in one step."""

    destination: Destination
    request: Request
    positions: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    rows: StoredRows
    dtype: torch.dtype


class PrefixRows:
    def __init__(self, store: ActivationStore, model_dtype: torch.dtype, hash_blocks: Callable[[Request], None]):
        """``hash_blocks(request)`` extends ``request.block_hashes`` over its full blocks (the prefix
        cache's chain)."""
        self.store = store
        self.model_dtype = model_dtype
        self.hash_blocks = hash_blocks
        self._pending: dict[str, tuple[Request, list[_Cover]]] = {}  # by request id, until it is planned

    def kind(self, hook: str, dtype: torch.dtype | None, sae: str | None, top_k: int) -> Kind | None:
        """What rows of this hook, dtype and SAE are stored as (None: attention patterns, never stored)."""
        if hook == ATTENTION_PATTERNS:
            return None
        return hook, dtype or self.model_dtype, sae, top_k

    def forget(self, request: Request) -> None:
        """A new lookup of ``request`` replaces its last one."""
        self._pending.pop(request.request_id, None)

    def cover(self, request: Request, destination: Destination, selector: RowSelector, first: int,
              hit_tokens: int) -> int:
        """Where a hit of ``hit_tokens`` may stop for ``destination``, whose first needed prompt row
        is ``first`` (below the hit): past the stored blocks, at the first row it needs after them."""
        kind = self.kind(destination.hook, destination.dtype, destination.sae, destination.top_k)
        if kind is None:
            return first
        bs = self.store.block_size
        first_block, hit_blocks = first // bs, hit_tokens // bs
        end = self.store.covered(request.block_hashes, first_block, hit_blocks, kind, destination.layers)
        entries = self.store.take(request.block_hashes[first_block:end], kind)
        covers = self._pending.setdefault(request.request_id, (request, []))[1]
        covers.append(_Cover(destination, selector, first_block, end, hit_blocks, entries, kind))
        return selector.first_prompt_position(max(first, end * bs), request.num_prompt_tokens)

    def serve(self, scheduled: Sequence[ScheduledRequest]) -> list[ServedRows]:
        """The rows each destination of a request admitted this step takes from the store: those it
        selects between the request's high-water mark and the hit it resumed from. Lookups of
        requests that were not admitted are dropped (they are looked up again)."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, {}
        served = []
        for item in scheduled:
            entry = pending.get(item.request.request_id)
            if entry is None or entry[0] is not item.request:
                continue
            request = item.request
            for cover in entry[1]:
                rows = self._rows(request, cover)
                if rows is not None:
                    served.append(rows)
        return served

    def _rows(self, request: Request, cover: _Cover) -> ServedRows | None:
        lo, hi = request.max_computed_tokens, request.num_computed_tokens
        selected = cover.selector.prompt_positions
        positions = np.arange(lo, hi) if selected is None else selected[(selected >= lo) & (selected < hi)]
        bs = self.store.block_size
        blocks = positions // bs - cover.first_block
        if len(positions) and (blocks[0] < 0 or blocks[-1] >= cover.end_block - cover.first_block):
            raise RuntimeError("activation store: a prefix hit passed the rows the store covers")
        served_blocks = np.unique(blocks)
        self.store.hits += len(served_blocks)
        self.store.misses += cover.hit_blocks - cover.end_block
        if not len(positions):
            return None
        layers = cover.destination.layers
        pieces: list[list[np.ndarray]] = [[] for _ in layers]
        bounds = np.searchsorted(blocks, served_blocks, side="right")
        start = 0
        for block, stop in zip(served_blocks.tolist(), bounds.tolist()):
            stored, offsets = cover.entries[block], positions[start:stop] % bs
            whole = stop - start == bs  # every row of the block: a view
            for i, layer in enumerate(layers):
                pieces[i].append(stored[layer] if whole else stored[layer][offsets])
            start = stop
        token_ids = np.asarray(request.prompt_token_ids, dtype=np.int32)[positions]
        return ServedRows(cover.destination, request, positions.astype(np.int32), token_ids,
                          StoredRows(pieces, len(positions)), cover.kind[1])

    def keep(self, group: PlannedGroup, rows: np.ndarray) -> None:
        """Store every whole prompt block of ``group``'s rows (``rows``: its host block ``[layers,
        rows, width]`` as ``host_array`` gives it) that the store does not hold yet."""
        hook, layers, dtype, _, sae, top_k = group.key
        kind = self.kind(hook, dtype, sae, top_k)
        if kind is None:
            return
        bs = self.store.block_size
        for request, where in _rows_by_request(group):
            positions = group.positions[where]
            end = min(int(positions[-1]) + 1, request.num_prompt_tokens)
            block = -(-int(positions[0]) // bs)
            while (block + 1) * bs <= end:
                j = int(np.searchsorted(positions, block * bs))
                if j + bs <= len(positions) and positions[j + bs - 1] == (block + 1) * bs - 1:
                    if block >= len(request.block_hashes):
                        self.hash_blocks(request)
                    block_hash = request.block_hashes[block]
                    if not self.store.has(block_hash, kind, layers):
                        index = where[j:j + bs]
                        self.store.put(block_hash, kind, {layer: rows[i, index] for i, layer in enumerate(layers)})
                block += 1


def _rows_by_request(group: PlannedGroup) -> list[tuple[Request, np.ndarray]]:
    """Each live request's rows in the group (sorted indices into its rows), once per request."""
    by_request: dict[int, tuple[Request, list[np.ndarray]]] = {}
    for _, request, where in group.takers:
        if request.finished or request.paused or not len(where):
            continue
        by_request.setdefault(id(request), (request, []))[1].append(where)
    return [(request, wheres[0] if len(wheres) == 1 else np.unique(np.concatenate(wheres)))
            for request, wheres in by_request.values()]
