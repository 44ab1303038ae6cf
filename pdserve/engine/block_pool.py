"""The block pool: fixed-size KV blocks, ref counts, a free queue in LRU order, prefix hashes.

A block is *free* when nobody references it (ref_cnt == 0). A free block may still hold a
cached prefix (it has a hash): it is reusable by a prefix hit until it is evicted, which
happens when it reaches the front of the free queue and a new block is needed.

    free queue:  front [LRU ... MRU] back     get_new_blocks pops the front (evicting its hash)
                                              free_blocks appends to the back
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None) -> BlockHash:
    """Hash of a full block: its parent's hash, its tokens, and an optional tenant salt.

    Stable across processes (unlike ``hash()``), so routers can index prefixes globally.
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\x00salt\x00" + salt.encode())
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class KVEvent:
    """A change to the set of cached prefix blocks, for the global prefix index."""

    kind: str  # "stored" | "removed"
    block_hashes: tuple[BlockHash, ...]


@dataclass
class BlockPool:
    num_blocks: int
    enable_caching: bool = True
    blocks: list[KVCacheBlock] = field(init=False)
    _free: OrderedDict[int, KVCacheBlock] = field(init=False)
    _cached: dict[BlockHash, KVCacheBlock] = field(init=False, default_factory=dict)
    events: list[KVEvent] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot take {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; pass blocks in the order they should be evicted (tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self._cached:
            self._cached[block_hash] = block
            self.events.append(KVEvent("stored", (block_hash,)))

    def _evict(self, block: KVCacheBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self._cached.get(h) is block:
            del self._cached[h]
            self.events.append(KVEvent("removed", (h,)))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def num_referenced(self) -> int:
        return sum(1 for b in self.blocks if b.ref_cnt > 0)
