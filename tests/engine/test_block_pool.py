"""The block pool and the KV cache manager on their own: hashes, ref counts, LRU eviction, and the
KV events a prefix index follows (bounded when nobody drains them, numbered, resyncable)."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict

from pdserve.engine.block_pool import BlockPool, KVEvent
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.prefix_hash import hash_block, root_hash
from tests.conftest import run_to_completion


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def test_hash_chain_is_stable_and_depends_on_parent_tokens_and_salt():
    """The scheme itself is pdserve/prefix_hash.py, pinned by tests/test_prefix_hash.py's vectors."""
    root, other_tenant = root_hash("m", 4), root_hash("m", 4, "tenant-b")
    a = hash_block(root, [1, 2, 3, 4])
    assert a == hash_block(root_hash("m", 4), [1, 2, 3, 4])
    assert a != hash_block(root, [1, 2, 3, 5])
    assert hash_block(a, [5, 6]) != hash_block(root, [5, 6])
    assert hash_block(other_tenant, [1, 2, 3, 4]) != a


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
    events = pool.events.drain()
    assert [e.kind for e in events] == ["stored", "stored", "stored", "removed"]
    assert [e.seq for e in events] == [1, 2, 3, 4] and pool.events.drain() == []


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


def test_the_free_queue_hands_out_blocks_in_the_order_of_a_reference_queue():
    """The queue threaded through the blocks against an ordered dict of the same operations: random
    takes, frees (a reference dropped, in a random order) and touches of free blocks; every block
    handed out, its place, the free count, the cached hashes."""
    rng = random.Random(5)
    pool = BlockPool(24)
    reference: OrderedDict[int, int] = OrderedDict()  # block id -> ref count of the free ones (0)
    made, held = 0, []  # ids never used are the front of the queue, lowest first
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and pool.num_free_blocks:
            n = rng.randint(1, min(4, pool.num_free_blocks))
            fresh = min(n, 24 - made)
            expected = list(range(made, made + fresh)) + [reference.popitem(last=False)[0] for _ in range(n - fresh)]
            made += fresh
            got = pool.get_new_blocks(n)
            assert [b.block_id for b in got] == expected, step
            for b in got:
                assert pool.get_cached_block(bytes([b.block_id]) * 16) is None  # evicted when taken
                pool.cache_block(b, bytes([b.block_id]) * 16)
            held += got
        elif op < 0.8 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            freed, held = held[:k], held[k:]
            pool.free_blocks(freed)
            for b in freed:
                if b.ref_cnt == 0:
                    reference[b.block_id] = 0
        elif reference:
            block_id = rng.choice(list(reference))
            block = pool.get_cached_block(bytes([block_id]) * 16)
            assert block is not None and block.block_id == block_id
            pool.touch([block])
            del reference[block_id]
            held.append(block)
        assert pool.num_free_blocks == len(reference) + 24 - made, step


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


# ---- KV events ------------------------------------------------------------------------------------


class IndexReplica:
    """What a prefix index keeps of one worker: its cached hashes, rebuilt from a snapshot on a gap."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.seq = 0
        self.resyncs = 0

    def apply(self, events: list[KVEvent], pool: BlockPool) -> None:
        for e in events:
            if e.seq > self.seq + 1:  # events were dropped: start again from the pool's block list
                snapshot = pool.snapshot()
                self.hashes, self.seq = set(snapshot.block_hashes), snapshot.seq
                self.resyncs += 1
            if e.seq <= self.seq:  # already in the snapshot
                continue
            if e.kind == "stored":
                self.hashes.update(e.block_hashes)
            elif e.kind == "removed":
                self.hashes.difference_update(e.block_hashes)
            else:
                assert e.kind == "cleared"
                self.hashes.clear()
            self.seq = e.seq


def test_events_kept_are_bounded_and_the_overflow_counted():
    pool = BlockPool(2)  # keeps 4 x 2 events
    for i in range(10):  # each round: one block cached, then evicted by the next get_new_blocks
        (b,) = pool.get_new_blocks(1)
        pool.cache_block(b, bytes([i]) * 16)
        pool.free_blocks([b])
    # 10 stored, 8 removed (the last two blocks cached are still cached)
    assert pool.events.last_seq == 10 + 8 and len(pool.events) == 8 and pool.events.dropped == 10
    assert [e.seq for e in pool.events.drain()] == list(range(11, 19))
    assert len(pool.events) == 0 and pool.events.dropped == 10


def test_reset_prefix_cache_is_one_cleared_event_and_an_empty_snapshot():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 16)
    assert not pool.reset_prefix_cache()  # blocks in use
    pool.free_blocks(blocks)
    assert set(pool.snapshot().block_hashes) == {bytes([0]) * 16, bytes([1]) * 16}
    assert pool.reset_prefix_cache()
    assert [(e.seq, e.kind, e.block_hashes) for e in pool.events.drain()][-1] == (3, "cleared", ())
    snapshot = pool.snapshot()
    assert (snapshot.seq, snapshot.block_hashes, snapshot.epoch) == (3, (), pool.events.epoch)
    assert pool.get_cached_block(bytes([0]) * 16) is None


def prompts(n: int, length: int = 40) -> list[list[int]]:
    """Distinct prompts: every one fills new blocks, so the cache churns."""
    return [[1000 + length * i + j for j in range(length)] for i in range(n)]


def add_requests(engine, token_lists: list[list[int]], prefix: str) -> None:
    for i, tokens in enumerate(token_lists):
        engine.add_request(f"{prefix}{i}", tokens, SamplingParams(max_tokens=4, temperature=0))


def test_engine_without_a_consumer_keeps_a_bounded_event_buffer(make_engine):
    engine = make_engine(num_kv_blocks=16)
    buffer = engine.kv.pool.events
    add_requests(engine, prompts(30), "r")
    run_to_completion(engine)
    # 30 prompts of 2 full blocks each: 60 stored, and all but the 16 blocks' worth removed again
    assert buffer.last_seq >= 60 + 60 - 16
    assert len(buffer) == 4 * 16 and buffer.dropped == buffer.last_seq - len(buffer)


def test_a_consumer_draining_while_the_engine_runs_sees_every_event_in_order(make_engine):
    engine = make_engine(num_kv_blocks=64)
    pool, replica, seqs = engine.kv.pool, IndexReplica(), []
    add_requests(engine, prompts(30), "r")
    stepping = threading.Thread(target=run_to_completion, args=(engine,))
    stepping.start()
    while stepping.is_alive():  # the engine thread appends while this one drains
        events = pool.events.drain()
        seqs += [e.seq for e in events]
        replica.apply(events, pool)
        stepping.join(0.001)
    events = pool.events.drain()
    seqs += [e.seq for e in events]
    replica.apply(events, pool)
    assert seqs == list(range(1, pool.events.last_seq + 1)) and pool.events.dropped == 0
    assert replica.resyncs == 0 and replica.hashes == set(pool.snapshot().block_hashes)


def test_a_consumer_that_missed_events_resyncs_from_the_snapshot(make_engine):
    engine = make_engine(num_kv_blocks=16)
    pool, replica = engine.kv.pool, IndexReplica()
    add_requests(engine, prompts(2), "a")
    run_to_completion(engine)
    replica.apply(pool.events.drain(), pool)
    add_requests(engine, prompts(40)[2:], "b")  # nobody drains: the buffer overflows
    run_to_completion(engine)
    assert pool.events.dropped > 0
    replica.apply(pool.events.drain(), pool)
    assert replica.resyncs == 1 and replica.hashes == set(pool.snapshot().block_hashes)
    add_requests(engine, prompts(44)[40:], "c")  # and it follows the events after the snapshot
    run_to_completion(engine)
    replica.apply(pool.events.drain(), pool)
    assert replica.resyncs == 1 and replica.seq == pool.events.last_seq
    assert replica.hashes == set(pool.snapshot().block_hashes)
