"""The block pool: fixed-size KV blocks, ref counts, a free queue in LRU order, prefix hashes.

A block is *free* when nobody references it (ref_cnt == 0). A free block may still hold a
cached prefix (it has a hash): it is reusable by a prefix hit until it is evicted, which
happens when it reaches the front of the free queue and a new block is needed.

    free queue:  front [never used | LRU ... MRU] back    get_new_blocks pops the front (evicting
                                                         its hash); free_blocks appends to the back

Every change to the set of cached hashes is a ``KVEvent`` in ``events``, a bounded buffer that
whoever publishes them (the worker's registration) drains; nobody draining costs the oldest
events, counted, never unbounded memory.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

# Hashes are computed by the one scheme the router shares (pdserve/prefix_hash.py); the pool only
# keys its cached blocks by them.
from pdserve.prefix_hash import BlockHash


@dataclass(eq=False, slots=True)  # slots: a simulated cluster holds millions of them
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Whether its hash is in the pool's events and snapshots (the router's prefix index). A block
    # of a sliding-window layer group is cached under a key of its own that no router computes
    # (see kv_cache_manager.HybridKVCacheManager).
    published: bool = True
    # Its neighbours in the pool's free queue while it is in it (a list threaded through the blocks,
    # as vLLM's FreeKVCacheBlockQueue: no dictionary entry per free block to make, hash and free).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class KVEvent(NamedTuple):
    """A change to the set of cached prefix blocks, for the global prefix index. (A tuple: one is
    made for every block cached or evicted, and a frozen dataclass cost several times as much.)"""

    seq: int  # from 1, consecutive within the pool's epoch
    kind: str  # "stored" | "removed" | "cleared" (every cached block forgotten; no hashes)
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Every cached block's hash, as of event ``seq``: what a consumer rebuilds from after a gap
    (a missing seq or a new epoch), before applying the events after ``seq``."""

    epoch: str
    seq: int
    block_hashes: tuple[BlockHash, ...]


class KVEventBuffer:
    """The pool's events until someone drains them; when full, the oldest is dropped and counted.

    The engine thread appends and a publisher on another thread drains, hence the lock. The
    epoch is a fresh random id per pool, so a consumer tells a restarted worker's events (seq
    from 1 again) from a gap.
    """

    def __init__(self, max_events: int):
        """``max_events`` 0: nobody reads them (a simulated replica without a prefix index): none kept."""
        self.epoch = secrets.token_hex(8)
        self.last_seq = 0
        self.dropped = 0
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._events)

    def append(self, kind: str, block_hashes: tuple[BlockHash, ...]) -> None:
        if not self._events.maxlen:
            return
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1  # the deque pushes its oldest event out
            self.last_seq += 1
            self._events.append(KVEvent(self.last_seq, kind, block_hashes))

    def drain(self) -> list[KVEvent]:
        """The events kept since the last drain, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events


@dataclass
class BlockPool:
    num_blocks: int
    enable_caching: bool = True
    blocks: list[KVCacheBlock] = field(init=False)
    # The free queue: a ring through the free blocks' prev_free/next_free, from and back to this
    # sentinel (its next_free the front, its prev_free the back), and how many it holds.
    _free: KVCacheBlock = field(init=False)
    _num_queued: int = field(init=False, default=0)
    _cached: dict[BlockHash, KVCacheBlock] = field(init=False, default_factory=dict)
    events: KVEventBuffer = field(init=False)

    def __post_init__(self) -> None:
        # Blocks are made on first use (``blocks`` holds those made, block i at index i): a pool
        # never filled, as a simulated replica's, costs no object per block. The free queue is
        # then the ids never used, lowest first (always at its front), and ``_free`` after them.
        self.blocks = []
        self._free = KVCacheBlock(-1)
        self._free.prev_free = self._free.next_free = self._free
        # A consumer further behind than this does better to resync from snapshot() (at most
        # num_blocks hashes) than to replay; the margin covers a heartbeat's worth of churn.
        self.events = KVEventBuffer(4 * self.num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self._num_queued + self.num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks, {self.num_free_blocks} free")
        made = len(self.blocks)
        fresh = min(n, self.num_blocks - made)  # never used (the queue's front): no cached prefix to evict
        out = [KVCacheBlock(i, 1) for i in range(made, made + fresh)]
        self.blocks.extend(out)
        head, cached = self._free, self._cached
        self._num_queued -= n - fresh
        for _ in range(n - fresh):
            block = head.next_free  # the front
            head.next_free = after = block.next_free
            after.prev_free = head
            block.prev_free = block.next_free = None
            h = block.block_hash
            if h is not None:  # its cached prefix evicted
                block.block_hash = None
                if cached.get(h) is block:
                    del cached[h]
                    if block.published:
                        self.events.append("removed", (h,))
            block.ref_cnt = 1
            out.append(block)
        return out

    def unthread(self) -> None:
        """The free queue's links cut (the pool is done with): its blocks and sentinel reference each
        other in a ring, which only the cyclic collector would free otherwise (the simulator runs
        without it)."""
        head, block = self._free, self._free.next_free
        while block is not None and block is not head:
            block.prev_free, block.next_free, block = None, None, block.next_free
        head.prev_free = head.next_free = None
        self._num_queued = 0

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:  # out of the free queue
                before, after = block.prev_free, block.next_free
                before.next_free, after.prev_free = after, before
                block.prev_free = block.next_free = None
                self._num_queued -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; pass blocks in the order they should be evicted (tail first)."""
        head = self._free
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:  # to the back of the free queue
                last = head.prev_free
                last.next_free = head.prev_free = block
                block.prev_free, block.next_free = last, head
                self._num_queued += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, publish: bool = True) -> None:
        """Offer ``block`` to prefix hits under ``block_hash``; ``publish``: as an event too."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.published = publish
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            if publish:
                self.events.append("stored", (block_hash,))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self.events.append("cleared", ())
        return True

    def snapshot(self) -> KVSnapshot:
        """Every cached hash and the last event it reflects; call it on the thread that owns the pool."""
        return KVSnapshot(self.events.epoch, self.events.last_seq,
                          tuple(h for h, block in self._cached.items() if block.published))

    def num_referenced(self) -> int:
        return sum(1 for b in self.blocks if b.ref_cnt > 0)
