"""Block manager: ref counts, LRU reuse, chained hashes with extra keys, the last-token rule."""

from steerable.engine.kv_cache import KVCacheManager
from steerable.request import Request
from steerable.sampling_params import SamplingParams


def _req(rid, tokens, salt=None, keys=()):
    r = Request(rid, rid, None, tokens, SamplingParams(cache_salt=salt), 0, [])
    r.hash_keys.extend(keys)
    return r


def _run_prefill(kv, req):
    cached, hit = kv.find_cached_prefix(req, req.num_tokens - 1)
    assert kv.allocate(req, req.num_tokens - hit, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return hit


def test_shared_prefix_hits_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = _req("a", list(range(1, 13)))  # 3 full blocks
    assert _run_prefill(kv, a) == 0
    b = _req("b", list(range(1, 13)))  # identical prompt: the last block must be recomputed
    assert _run_prefill(kv, b) == 8
    (a_blocks,), (b_blocks,) = a.block_ids, b.block_ids  # one KV group
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert kv.ref_counts[a_blocks[0]] == 2
    c = _req("c", list(range(1, 9)) + [99, 98, 97, 96, 95])
    assert _run_prefill(kv, c) == 8


def test_extra_keys_separate_and_reach_only_later_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 18))
    _run_prefill(kv, _req("plain", tokens))
    assert _run_prefill(kv, _req("salted", tokens, salt="s1")) == 0  # salt applies from position 0
    assert _run_prefill(kv, _req("salted2", tokens, salt="s1")) == 16
    # A key that first applies at position 9 leaves blocks [0,4) and [4,8) shareable.
    assert _run_prefill(kv, _req("late", tokens, keys=[(9, b"steer:x")])) == 8
    assert _run_prefill(kv, _req("late2", tokens, keys=[(9, b"steer:y")])) == 8
    assert _run_prefill(kv, _req("late3", tokens, keys=[(9, b"steer:x")])) == 16


def test_free_lru_order_and_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = _req("a", [1, 2, 3, 4, 5])
    _run_prefill(kv, a)
    a_blocks = list(a.block_ids[0])
    kv.free(a)
    assert kv.num_free_blocks == 4 and a.block_ids == []
    # Freed in reverse: after the never-used block, a's tail is reused first; its prefix survives.
    b = _req("b", [9, 9, 9])
    _run_prefill(kv, b)
    unused = ({0, 1, 2, 3} - set(a_blocks)).pop()
    assert b.block_ids == [[unused, a_blocks[2]]]
    kv.free(b)
    c = _req("c", [1, 2, 3, 4, 7])
    assert _run_prefill(kv, c) == 4  # a's first two blocks are still cached
    kv.free(c)
    assert kv.num_free_blocks == 4 and all(r == 0 for r in kv.ref_counts)


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a = _req("a", list(range(10)))
    assert not kv.allocate(a, 13)
    assert a.block_ids == [[]] and kv.num_free_blocks == 3
    assert kv.allocate(a, 10) and kv.num_free_blocks == 0


def test_cache_salt_end_to_end(model_dirs):
    from steerable import LLM
    llm = LLM(model_dirs["llama"], device="cpu", kv_cache_tokens=2048)
    prompt = list(range(5, 60))
    p = SamplingParams(max_tokens=2, temperature=0)
    base = llm.generate([prompt], p, use_tqdm=False)
    hits = llm.llm_engine.stats()["prefix_cache_hit_tokens"]
    salted = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, cache_salt="tenant-a"),
                          use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_hit_tokens"] == hits
    llm.generate([prompt], p, use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_hit_tokens"] > hits
    assert salted[0].outputs[0].token_ids == base[0].outputs[0].token_ids
