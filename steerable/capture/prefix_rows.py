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
        entries = self.store.take_run(request.block_hashes, first_block, hit_blocks, kind, destination.layers)
        end = first_block + len(entries)
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
        """The rows ``cover``'s destination selects below the hit the request resumed from (and at
        or above its high-water mark): the stored blocks they lie in, cut when they are copied."""
        lo, hi = request.max_computed_tokens, request.num_computed_tokens
        selected = cover.selector.prompt_positions
        positions = np.arange(lo, hi) if selected is None else selected[(selected >= lo) & (selected < hi)]
        bs, first = self.store.block_size, cover.first_block
        if len(positions) and (positions[0] < first * bs or positions[-1] >= cover.end_block * bs):
            raise RuntimeError("activation store: a prefix hit passed the rows the store covers")
        self.store.misses += cover.hit_blocks - cover.end_block
        if not len(positions):
            return None
        layers, prompt = cover.destination.layers, request.prompt_token_ids
        start, stop = int(positions[0]), int(positions[-1]) + 1
        run = stop - start == len(positions)  # consecutive rows: every prompt row's case
        entries = cover.entries[start // bs - first:-(-stop // bs) - first]
        self.store.hits += len(entries) if run else len(np.unique(positions // bs))
        picks = None if run else positions - start // bs * bs
        token_ids = np.array(prompt[start:stop] if run else [prompt[p] for p in positions.tolist()], np.int32)
        return ServedRows(cover.destination, request, positions.astype(np.int32), token_ids,
                          StoredRows(entries, layers, start % bs, len(positions), picks), cover.kind[1])

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
            first, count = int(positions[0]), len(positions)
            run = int(positions[-1]) - first + 1 == count  # a chunk's rows: consecutive positions
            end = min(int(positions[-1]) + 1, request.num_prompt_tokens)
            blocks = range(-(-first // bs), end // bs)
            if not blocks:
                continue
            if blocks[-1] >= len(request.block_hashes):
                self.hash_blocks(request)
            sliced = int(where[-1]) - int(where[0]) + 1 == len(where)  # consecutive rows of the block
            for block in blocks:
                j = block * bs - first if run else int(np.searchsorted(positions, block * bs))
                if not run and (j + bs > count or positions[j + bs - 1] != (block + 1) * bs - 1):
                    continue  # a row of the block is not captured here
                block_hash = request.block_hashes[block]
                if self.store.has(block_hash, kind, layers):
                    continue
                index = slice(int(where[j]), int(where[j]) + bs) if sliced else where[j:j + bs]
                self.store.put(block_hash, kind, {layer: rows[i, index].copy() for i, layer in enumerate(layers)})


def _rows_by_request(group: PlannedGroup) -> list[tuple[Request, np.ndarray]]:
    """Each live request's rows in the group (sorted indices into its rows), once per request."""
    by_request: dict[int, tuple[Request, list[np.ndarray]]] = {}
    for _, request, where in group.takers:
        if request.finished or request.paused or not len(where):
            continue
        by_request.setdefault(id(request), (request, []))[1].append(where)
    return [(request, wheres[0] if len(wheres) == 1 else np.unique(np.concatenate(wheres)))
            for request, wheres in by_request.values()]
