"""The block pool and the KV cache manager on their own: hashes, ref counts, LRU eviction."""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool, hash_block
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def test_hash_chain_is_stable_and_depends_on_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != hash_block(None, [1, 2, 3, 4], "tenant-b")
    assert hash_block(None, [1, 2, 3, 4], "tenant-a") != a


def test_pool_ref_counts_and_lru_eviction_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and pool.num_free_blocks == 1
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 16)
    pool.free_blocks(reversed(blocks))  # tail first: blocks[2] is the first to go
    assert pool.num_free_blocks == 4 and pool.num_referenced() == 0
    assert pool.get_cached_block(bytes([0]) * 16) is blocks[0]
    first, second = pool.get_new_blocks(2)  # the never-used block, then the tail block
    assert second is blocks[2] and pool.get_cached_block(bytes([2]) * 16) is None
    assert pool.get_cached_block(bytes([0]) * 16) is blocks[0]
    kinds = [e.kind for e in pool.take_events()]
    assert kinds == ["stored", "stored", "stored", "removed"]


def test_touch_takes_a_cached_free_block_out_of_the_free_queue():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h" * 16)
    pool.free_blocks([b])
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.touch([b])
    pool.free_blocks([b, b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2


def test_manager_prefix_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(12))
    r1 = make_request("a", tokens)
    assert kv.allocate_slots(r1, 12) is not None  # 3 blocks, all full and cached
    r2 = make_request("b", tokens)
    hits = kv.get_computed_blocks(r2)
    assert len(hits) == 2  # 12 tokens: at most 11 may come from the cache -> 2 full blocks
    r3 = make_request("c", tokens + [99])
    assert len(kv.get_computed_blocks(r3)) == 3
    r4 = make_request("d", tokens + [99], salt="other-tenant")
    assert kv.get_computed_blocks(r4) == []
    kv.free(r1)
    assert kv.pool.num_referenced() == 0


def test_manager_refuses_when_full_and_counts_evictable_hits():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r1 = make_request("a", list(range(8)))
    kv.allocate_slots(r1, 8)
    kv.free(r1)  # 2 cached free blocks + 2 empty free blocks
    r2 = make_request("b", list(range(8)) + [50] * 9)  # 17 tokens: 5 blocks
    hits = kv.get_computed_blocks(r2)
    assert len(hits) == 2
    r2.num_computed_tokens = 0
    assert kv.allocate_slots(r2, 17 - 8, hits) is None  # needs 3 new besides the 2 hits: only 2 remain
    assert kv.block_ids("b") == []
    assert kv.allocate_slots(r2, 16 - 8 - 4, hits) is not None  # 3 blocks in all fit
    kv.free(r2)
    assert kv.pool.num_referenced() == 0


def test_delayed_caching_hides_blocks_until_filled():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r1 = make_request("a", list(range(9)))
    kv.allocate_slots(r1, 9, delay_caching=True)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == []
    kv.cache_blocks(r1, 9)
    assert len(kv.get_computed_blocks(make_request("c", list(range(9))))) == 2
    kv.free(r1)
