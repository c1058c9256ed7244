"""Paged KV block bookkeeping: allocation, ref counts, LRU reuse and prefix caching.

The KV tensors themselves live in the model runner; this module only decides which physical block
holds which 'block_size' tokens of which request. A full block is identified by a chained hash over
(parent hash, its token ids, the request's extra keys that reach it), so two requests share a block
only when every token before and inside it, and everything else that shaped its KV (cache salt,
prefill steering), is the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from steerable.request import Request

_ROOT_HASH = b"steerable-kv-root"


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[bytes]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in token_ids))
    for key in extra_keys:
        h.update(b"|")
        h.update(key)
    return h.digest()


class KVCacheManager:
    """Owns the free list and the hash -> block map; requests own lists of block ids."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Insertion order is eviction order: the head is the least recently freed block.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.query_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's hash chain over every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), (request.num_tokens - request.num_pending) // bs):
            start, end = i * bs, (i + 1) * bs
            keys = [key for first_pos, key in request.hash_keys if first_pos < end]
            parent = hashes[i - 1] if i else _ROOT_HASH
            hashes.append(hash_block(parent, request.all_token_ids[start:end], keys))

    def find_cached_prefix(self, request: Request, max_tokens: int) -> tuple[list[int], int]:
        """Longest run of cached blocks covering at most ``max_tokens`` leading tokens.

        The caller caps ``max_tokens`` below the last prompt token (its logits are needed) and
        below any prompt row that capture must see computed.
        """
        if not self.enable_prefix_caching or request.params.skip_reading_prefix_cache:
            return [], 0
        self.update_block_hashes(request)
        hits: list[int] = []
        for block_hash in request.block_hashes[: max_tokens // self.block_size]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens (after ``cached_blocks``).

        All or nothing: returns False and changes nothing when the blocks are not there.
        """
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        needed = self.blocks_for(total) - len(request.block_ids) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if needed > self.num_free_blocks - revived:
            return False
        for block in cached_blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        request.block_ids.extend(cached_blocks)
        if cached_blocks:
            self.num_cached_blocks[request.request_id] = len(request.block_ids)
        for _ in range(max(needed, 0)):
            block, _ = self.free_blocks.popitem(last=False)
            stale = self.block_hash[block]
            if stale is not None:
                if self.cached_blocks.get(stale) == block:
                    del self.cached_blocks[stale]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

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
        self.update_block_hashes(request)
        for i in range(done, num_full):
            block_hash, block = request.block_hashes[i], request.block_ids[i]
            if block_hash not in self.cached_blocks and self.block_hash[block] is None:
                self.cached_blocks[block_hash] = block
                self.block_hash[block] = block_hash
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return the request's blocks; cached ones stay findable until their memory is reused."""
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        request.block_ids = []
        self.num_cached_blocks.pop(request.request_id, None)

    def truncate_hashes(self, request: Request, num_tokens: int) -> None:
        """The request's tokens from ``num_tokens`` on changed: hashes of blocks reaching them go."""
        del request.block_hashes[num_tokens // self.block_size:]
