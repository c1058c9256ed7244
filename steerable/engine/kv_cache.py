"""Paged KV block bookkeeping: allocation, ref counts, LRU reuse, prefix caching, sliding windows.

The KV tensors themselves live in the model runner; this module only decides which physical block
holds which 'block_size' tokens of which request, for each KV group (``steerable.kv_groups``):
every request has one block list per group, all of the same logical length, drawn from one pool.
When a request takes blocks, its sliding-window groups first release the blocks wholly before the
window of its next chunk (their list entries become ``NULL_BLOCK``), so long contexts cost
window-sized memory on those layers.

A full block is identified by a chained hash over (parent hash, its token ids, the request's extra
keys that reach it), so two requests share a block only when every token before and inside it, and
everything else that shaped its KV (cache salt, prefill steering), is the same. Each group caches
its own block under that hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from steerable.request import Request

_ROOT_HASH = b"steerable-kv-root"
NULL_BLOCK = -1  # a logical block a sliding-window group does not hold (before its window)


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[bytes]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())  # fixed-width ids: no separators needed
    for key in extra_keys:
        h.update(b"|")
        h.update(key)
    return h.digest()


class KVCacheManager:
    """Owns the free list and the (group, hash) -> block map; requests own one list of block ids
    per group. ``windows[g]`` is group g's sliding window (None: full attention)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: Sequence[int | None] = (None,)):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows)
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks
        # Insertion order is eviction order: the head is the least recently freed block.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[tuple[int, bytes], int] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed(self, group: int, start: int) -> int:
        """The first logical block a chunk starting at position ``start`` reads in ``group``."""
        window = self.windows[group]
        return 0 if window is None else max(0, start - window + 1) // self.block_size

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), (request.num_tokens - request.num_pending) // bs):
            start, end = i * bs, (i + 1) * bs
            keys = [key for first_pos, key in request.hash_keys if first_pos < end]
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block(parent, request.all_token_ids[start:end], keys))

    def find_cached_prefix(self, request: Request, max_tokens: int) -> tuple[list[list[int]], int]:
        """Per group, the cached blocks of the longest prefix (at most ``max_tokens`` leading
        tokens) that every group can resume from: full groups hold all of it, windowed groups the
        blocks the next chunk's window reads (``NULL_BLOCK`` before them).

        The caller caps ``max_tokens`` below the last prompt token (its logits are needed) and
        below any prompt row that capture must see computed.
        """
        empty: list[list[int]] = [[] for _ in self.windows]
        # A request reporting prompt logprobs computes every prompt row (cached blocks carry no logits).
        if (not self.enable_prefix_caching or request.params.skip_reading_prefix_cache
                or request.prompt_logprobs is not None):
            return empty, 0
        self.update_block_hashes(request)
        hashes = request.block_hashes[: max_tokens // self.block_size]
        found = [[self.cached_blocks.get((g, h)) for h in hashes] for g in range(self.num_groups)]
        n = len(hashes)
        for g, blocks in enumerate(found):  # a full group needs every block up to the hit's end
            if self.windows[g] is None:
                n = min(n, next((i for i, b in enumerate(blocks) if b is None), n))
        while n and not all(None not in blocks[self.first_needed(g, n * self.block_size):n]
                            for g, blocks in enumerate(found)):  # a windowed one the window before it
            n -= 1
        if not n:
            return empty, 0
        start = n * self.block_size
        return [[NULL_BLOCK] * self.first_needed(g, start) + blocks[self.first_needed(g, start):n]
                for g, blocks in enumerate(found)], start

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[Sequence[int]] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens (after ``cached_blocks``, one
        list per group), first releasing windowed blocks its next chunk no longer reads.

        All or nothing: returns False and takes nothing when the blocks are not there.
        """
        if not request.block_ids:
            request.block_ids = [[] for _ in self.windows]
        self._release_outside_windows(request)
        cached = list(cached_blocks) or [[] for _ in self.windows]
        total = request.num_computed_tokens + len(cached[0]) * self.block_size + num_new_tokens
        target = self.blocks_for(total)
        needed = [target - len(own) - len(hit) for own, hit in zip(request.block_ids, cached)]
        if not any(n > 0 for n in needed) and not cached[0]:
            return True
        revived = sum(1 for hit in cached for b in hit if b != NULL_BLOCK and self.ref_counts[b] == 0)
        if sum(max(n, 0) for n in needed) > self.num_free_blocks - revived:
            return False
        for own, hit in zip(request.block_ids, cached):
            for block in hit:
                if block == NULL_BLOCK:
                    continue
                if self.ref_counts[block] == 0:
                    del self.free_blocks[block]
                self.ref_counts[block] += 1
            own.extend(hit)
        if cached[0]:
            self.num_cached_blocks[request.request_id] = len(request.block_ids[0])
        for own, n in zip(request.block_ids, needed):
            own.extend(self._take() for _ in range(max(n, 0)))
        return True

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        stale = self.block_hash[block]
        if stale is not None:
            if self.cached_blocks.get(stale) == block:
                del self.cached_blocks[stale]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _release_outside_windows(self, request: Request) -> None:
        """Hand back windowed blocks wholly before the window of a chunk starting at
        ``num_computed_tokens``; full ones stay findable by their hash until reused. (The step in
        flight may still read them: a block taken now is written only by a later step.)"""
        start = request.num_computed_tokens
        for g, own in enumerate(request.block_ids):
            if self.windows[g] is None:
                continue
            i = min(self.first_needed(g, start), len(own)) - 1
            while i >= 0 and own[i] != NULL_BLOCK:
                self._publish(request, g, i)
                self._unref(own[i])
                own[i] = NULL_BLOCK
                i -= 1

    def _publish(self, request: Request, group: int, index: int) -> None:
        """Make a computed full block findable under its hash, unless another block already is."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        if index >= len(request.block_hashes):
            return
        key, block = (group, request.block_hashes[index]), request.block_ids[group][index]
        if key not in self.cached_blocks and self.block_hash[block] is None:
            self.cached_blocks[key] = block
            self.block_hash[block] = key

    def _unref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks for reuse by later requests."""
        if not self.enable_prefix_caching:
            return
        known = request.num_tokens - request.num_pending
        # A streaming-input chunk may end on the last known token, which is then dropped and its
        # slot rewritten: its block is published only once the token is no longer last.
        num_full = min(request.num_computed_tokens, known - 1 if request.resumable else known) // self.block_size
        done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= done:
            return
        for g, own in enumerate(request.block_ids):
            for i in range(done, num_full):
                if own[i] != NULL_BLOCK:
                    self._publish(request, g, i)
        self.num_cached_blocks[request.request_id] = num_full

    def num_published(self, request: Request) -> int:
        """How many of the request's leading blocks other requests can find in the cache now."""
        return self.num_cached_blocks.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Return the request's blocks; cached ones stay findable until their memory is reused."""
        for own in request.block_ids:
            for block in reversed(own):
                if block != NULL_BLOCK:
                    self._unref(block)
        request.block_ids = []
        self.num_cached_blocks.pop(request.request_id, None)

    def truncate_hashes(self, request: Request, num_tokens: int) -> None:
        """The request's tokens from ``num_tokens`` on changed: hashes of blocks reaching them go."""
        del request.block_hashes[num_tokens // self.block_size:]
