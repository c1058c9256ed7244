"""Sliding-window KV groups: layers grouped by window in one block pool, windowed groups handing
back the blocks before their window (memory stays window-sized), prefix hits that need only the
window's blocks, and end to end on Gemma 3 and Mistral: bounded memory, outputs unchanged."""

from __future__ import annotations

import random

import pytest
from conftest import hf_greedy, hf_model

from steerable import LLM, SamplingParams
from steerable.engine.kv_cache import NULL_BLOCK, KVCacheManager
from steerable.kv_groups import KVGroups
from steerable.request import Request
from steerable.sampling_params import SamplingParams as Params


def _gemma_windows(layers: int, window: int) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(layers)]


def test_groups_of_gemma_and_plain_models():
    g270m = KVGroups.build(_gemma_windows(18, 512))
    assert g270m.windows == (512,) * 5 + (None,) and g270m.slots == 3
    assert g270m.layers[-1] == (5, 11, 17) and g270m.layers[0] == (0, 1, 2)
    assert g270m.placement(11) == (5, 1) and g270m.placement(4) == (1, 1)
    g4b = KVGroups.build(_gemma_windows(34, 1024))  # 29 local layers in groups of 5: one slot idle in the last
    assert g4b.num_groups == 7 and g4b.slots == 5 and [len(x) for x in g4b.layers] == [5, 5, 5, 5, 5, 4, 5]
    plain = KVGroups.build([None] * 28)
    assert plain.num_groups == 1 and plain.slots == 28
    # One sequence alone: full groups hold it all, windowed ones a window plus a chunk.
    assert g270m.blocks_needed(32768, 16, 512) == 2048 + 5 * (-(-(511 + 512) // 16) + 1)
    assert g270m.max_tokens(2048 + 5 * 65, 16, 512, 10**6) == 32768
    assert plain.max_tokens(100, 16, 512, 10**6) == 1600


def _req(rid: str, n: int) -> Request:
    return Request(rid, rid, None, list(range(1, n + 1)), Params(), 0, [])


def _run(kv: KVCacheManager, req: Request, chunk: int) -> list[int]:
    """Compute a request chunk by chunk; the blocks it holds after each allocation."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate(req, n)
        req.num_computed_tokens += n
        kv.cache_computed_blocks(req)
        held.append(kv.num_blocks - kv.num_free_blocks)
    return held


def test_windowed_group_releases_blocks_before_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False, windows=[None, 6])
    req = _req("a", 100)
    held = _run(kv, req, chunk=3)
    full, local = req.block_ids
    assert len(full) == len(local) == 25 and NULL_BLOCK not in full
    # The window (6) before a 3-token chunk spans at most three blocks of 4.
    assert sum(b != NULL_BLOCK for b in local) <= 3 and local[:20] == [NULL_BLOCK] * 20
    assert max(held) <= 25 + 3
    kv.free(req)
    assert kv.num_free_blocks == 64 and all(r == 0 for r in kv.ref_counts)


def test_windowed_prefix_hit_needs_only_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True, windows=[None, 6])
    a = _req("a", 40)
    _run(kv, a, chunk=40)
    a_local = list(a.block_ids[1])
    assert kv.allocate(a, 1)  # its next chunk releases the windowed blocks before the window...
    assert a.block_ids[1][:8] == [NULL_BLOCK] * 8
    b = _req("b", 40)
    (full, local), hit = kv.find_cached_prefix(b, 39)
    assert hit == 36 and full == a.block_ids[0][:9]
    # ...which stay findable: a chunk starting at 36 reads keys from 31 on, blocks 7 and 8.
    assert local[:7] == [NULL_BLOCK] * 7 and local[7:] == a_local[7:9]
    assert kv.allocate(b, 4, [full, local])
    assert b.block_ids[1][7:9] == local[7:]
    # Block 8 of the windowed group evicted: the hit shrinks to where the window is still whole.
    kv.free(a), kv.free(b)
    kv.cached_blocks.pop((1, a.block_hashes[8]))
    (full, local), hit = kv.find_cached_prefix(_req("c", 40), 39)
    assert hit == 32 and local[6:] == [kv.cached_blocks[(1, a.block_hashes[i])] for i in (6, 7)]


def _long_prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    return [[rng.randrange(10, vocab) for _ in range(length + 17 * i)] for i in range(n)]


def _generate_tracking_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Outputs in prompt order and the most blocks in use after any step."""
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs, peak = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        stats = engine.stats()
        peak = max(peak, stats["num_blocks"] - stats["num_free_blocks"])
    return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))], peak


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_long_context_keeps_window_sized_memory(model_dirs, family):
    """Prompts of 150+ tokens against windows of 8 (Gemma's local layers) and 24 (every Mistral
    layer), prefilled in chunks of 32: the windowed groups hold a window and a chunk, and the
    tokens equal HF's."""
    path = model_dirs[family]
    llm = LLM(path, device="cpu", block_size=4, kv_cache_tokens=4096, max_num_batched_tokens=32)
    groups = KVGroups.for_model(llm.engine.model_config)
    assert any(w is not None for w in groups.windows)
    prompts = _long_prompts(llm, 2, 150)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tokens, peak = _generate_tracking_blocks(llm, prompts, params)
    longest = len(prompts[-1]) + 24
    unwindowed = 2 * groups.num_groups * -(-longest // 4)
    assert peak <= 2 * groups.blocks_needed(longest, 4, 32) < unwindowed
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    hf = hf_model(path)
    assert tokens == [hf_greedy(hf, p, 24) for p in prompts]
