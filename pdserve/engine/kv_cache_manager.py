"""Per-request block tables over the block pool, with prefix-cache lookups.

The scheduler asks three things: how much of a new request is already cached
(``get_computed_blocks``), whether there is room for the tokens it wants to compute this step
(``allocate_slots``, None when there is not), and to give a request's blocks back (``free``).

A model with sliding-window layers (Gemma 3) gets ``HybridKVCacheManager``, as vLLM's hybrid
allocator: the layers are split into groups of equal size (``KVGroups``), full-attention groups
and sliding-window groups, each with a block table of its own over one shared pool, a block
holding one group's layers. A sliding-window group's table keeps only the blocks its next
queries see; the blocks wholly before the window go back to the pool as decoding moves on
(their place in the table is the null block), so the local layers' KV stops growing at the
window while the global layers' grows with the sequence::

    Gemma 3 270M: 18 layers, every sixth global -> groups of 3 layers:
      group 0  layers 5 11 17     (full)     table [b b b b b b b b b b]   one block per 16 tokens
      group 1  layers 0 1 2       (window)   table [0 0 0 0 0 0 b b b b]   0: the null block
      ...
      group 5  layers 14 15 16    (window)   table [0 0 0 0 0 0 b b b b]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.config import ModelConfig
from pdserve.engine.request import Request
from pdserve.prefix_hash import extend_block_hashes, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroups:
    """Which block table each layer's KV lives in, and where in the cache tensor.

    The cache tensor has ``num_slots`` layer slots; layer ``l`` keeps its KV in slot
    ``layer_slot[l]`` at the blocks of its group's table (``layer_group[l]``). One group (every
    layer, slot = layer) is the plain cache.
    """

    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    windows: tuple[int, ...]  # per group: 0 keeps every block; > 0 only those the window sees

    @classmethod
    def one(cls, num_layers: int) -> KVGroups:
        """Every layer in one group, each in its own slot: the plain cache."""
        return cls((0,) * num_layers, tuple(range(num_layers)), (0,))

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, the window its KV is kept for (0: every block): what a KV transfer ships."""
        return tuple(self.windows[g] for g in self.layer_group)

    def first_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of ``group`` that a query at ``position`` sees (0 for a full group)."""
        window = self.windows[group]
        return max(0, position - window + 1) // block_size if window else 0


def kv_groups(cfg: ModelConfig, sliding_window_kv: bool = True) -> KVGroups:
    """One group, unless the model has sliding-window layers and ``sliding_window_kv``: then groups
    of ``gcd(full layers, sliding layers)`` layers, the full ones first."""
    n = cfg.num_layers
    sliding = [i for i in range(n) if cfg.is_sliding(i)]
    if not sliding_window_kv or not sliding:
        return KVGroups.one(n)
    full = [i for i in range(n) if not cfg.is_sliding(i)]
    size = math.gcd(len(full), len(sliding))
    group, slot, windows = [0] * n, [0] * n, []
    for layers, window in ((full, 0), (sliding, cfg.sliding_window)):
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                group[layer], slot[layer] = len(windows), j
            windows.append(window)
    return KVGroups(tuple(group), tuple(slot), tuple(windows))


class KVCacheManager:
    # Whether the scheduler shrinks the chunk of a request that runs alone and cannot get its
    # blocks (worth it where a sequence's blocks are bounded by a window; see HybridKVCacheManager).
    shrink_chunks = False
    # The block a table holds where it keeps none (layer groups' windows); None: tables have no holes.
    null_block: KVCacheBlock | None = None

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, model_fingerprint: str = ""):
        self.block_size = block_size
        # In every block hash's root (pdserve/prefix_hash.py): another model's KV never matches, and
        # the router's index computes the same hashes from the fingerprint workers announce.
        self.model_fingerprint = model_fingerprint
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of the request already hashed

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self._blocks.get(request_id))

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every layer group's block table; None with one group (``block_ids`` is its table)."""
        return None

    def fits(self, num_tokens: int, chunk_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens``, computed ``chunk_tokens`` at a time at most, fits
        in the cache when it has it to itself."""
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        hashes = request.block_hashes
        if len(hashes) < len(request.all_token_ids) // self.block_size:
            # The root is the first block's parent only: a chain already begun continues from its last.
            root = hashes[-1] if hashes else root_hash(self.model_fingerprint, self.block_size, request.cache_salt)
            extend_block_hashes(hashes, root, request.all_token_ids, self.block_size)

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that prefixes the request.

        At least one token is always left to compute, so the step produces logits for it.
        """
        if not self.enable_caching:
            return []
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Room for ``num_new_tokens`` after the computed ones (plus a prefix hit); None if full.

        ``delay_caching``: the new blocks will be filled from outside (remote KV), so they may
        not be offered to prefix hits until ``cache_blocks`` is called.
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Blocks of a prefix hit that sit in the free queue stop being free once touched.
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if new_computed_blocks else 0
        if need > 0 and need > self.pool.num_free_blocks - evictable_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new_blocks)
        if not delay_caching:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's full blocks covering its first ``num_tokens`` to prefix hits (every
        group's, with layer groups; the first group's are published)."""
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        if not self.enable_caching or num_tokens // self.block_size <= start:  # no block newly full
            return
        self.update_block_hashes(request)
        tables = self._tables_of(rid)
        if not tables:
            return
        hashes = request.block_hashes
        end = min(num_tokens // self.block_size, len(hashes), len(tables[0]))
        if end > start:
            self._cache_range(tables, hashes, start, end)
        self._num_cached[rid] = max(start, end)

    # With one group: its table, its blocks cached under their hashes (published).
    def _tables_of(self, request_id: str) -> list[list[KVCacheBlock]]:
        blocks = self._blocks.get(request_id)
        return [blocks] if blocks else []

    def _cache_range(self, tables: list[list[KVCacheBlock]], hashes: list[bytes], start: int, end: int) -> None:
        """Blocks ``start`` to ``end`` of the request's tables offered to prefix hits."""
        table, cache = tables[0], self.pool.cache_block
        for i in range(start, end):
            cache(table[i], hashes[i])

    def free(self, request: Request) -> None:
        """Give back the request's blocks; its tail is evicted before its shared prefix."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def num_requests(self) -> int:
        return len(self._blocks)


class HybridKVCacheManager(KVCacheManager):
    """Block tables per layer group over one pool; sliding-window groups give back the blocks
    their window has passed (see the module's docstring).

    Prefix caching per group: a full group's block is cached under the block's hash (published:
    the router's index sees it), a sliding-window group's under a key of its own (unpublished). A
    prefix hit of ``n`` blocks needs every full group's first ``n`` blocks and, in each sliding
    group, the blocks the window of position ``n * block_size`` sees; the hit is the longest
    ``n`` with both. Freed blocks stay cached until evicted, as in one group.
    """

    shrink_chunks = True

    def __init__(self, num_blocks: int, block_size: int, groups: KVGroups, enable_caching: bool = True,
                 model_fingerprint: str = ""):
        super().__init__(num_blocks, block_size, enable_caching, model_fingerprint)
        self.groups = groups
        # A table's hole: taken once, never freed, never cached, never read (a window's first
        # visible block is always a real one).
        self.null_block = self.pool.get_new_blocks(1)[0]
        self._tables: dict[str, list[list[KVCacheBlock]]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        tables = self._tables.get(request_id)
        return [b.block_id for b in tables[0]] if tables else []

    def holds_blocks(self, request_id: str) -> bool:
        tables = self._tables.get(request_id)
        return bool(tables and tables[0])

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        tables = self._tables.get(request_id)
        return [[b.block_id for b in table] for table in tables] if tables else None

    def _key(self, group: int, block_hash: bytes) -> bytes:
        return block_hash if group == 0 else bytes((group,)) + block_hash

    def _cache_range(self, tables: list[list[KVCacheBlock]], hashes: list[bytes], start: int, end: int) -> None:
        """Every group's blocks, each under its group's key (the first group's published); holes skipped."""
        for g, table in enumerate(tables):
            for i in range(start, end):
                if table[i] is not self.null_block:
                    self.pool.cache_block(table[i], self._key(g, hashes[i]), publish=g == 0)

    def get_computed_blocks(self, request: Request) -> list[tuple[KVCacheBlock, ...]]:
        """The longest cached prefix, as one tuple of blocks (a block per group) per block."""
        if not self.enable_caching:
            return []
        self.update_block_hashes(request)
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        groups, pool, bs = self.groups, self.pool, self.block_size
        full = [g for g in range(groups.num_groups) if not groups.windows[g]]
        sliding = [g for g in range(groups.num_groups) if groups.windows[g]]
        n = 0
        while n < len(hashes) and all(pool.get_cached_block(self._key(g, hashes[n])) for g in full):
            n += 1

        def window_cached(n: int) -> bool:
            return all(pool.get_cached_block(self._key(g, hashes[i])) is not None
                       for g in sliding for i in range(groups.first_block(g, n * bs, bs), n))

        while n > 0 and not window_cached(n):
            n -= 1
        firsts = [groups.first_block(g, n * bs, bs) for g in range(groups.num_groups)]
        return [tuple(self.null_block if i < firsts[g] else pool.get_cached_block(self._key(g, hashes[i]))
                      for g in range(groups.num_groups)) for i in range(n)]

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[tuple[KVCacheBlock, ...]] = (),
        delay_caching: bool = False,
    ) -> list[KVCacheBlock] | None:
        """As ``KVCacheManager.allocate_slots``, per group. In a sliding-window group, the blocks
        before the window of the first query left to compute are not taken, and those the table
        holds go back to the pool. ``delay_caching`` (remote KV): the new tokens are written from
        outside, so the first query left is the one after them."""
        rid, bs, groups = request.request_id, self.block_size, self.groups
        tables = self._tables.get(rid) or [[] for _ in range(groups.num_groups)]
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * bs
        total = cdiv(num_computed + num_new_tokens, bs)
        first_query = num_computed + num_new_tokens if delay_caching else num_computed
        have = len(tables[0]) + len(new_computed_blocks)
        firsts = [groups.first_block(g, first_query, bs) for g in range(groups.num_groups)]
        need = sum(total - max(have, first) for first in firsts if total > max(have, first))
        hit_blocks = {id(b): b for hit in new_computed_blocks for b in hit if b is not self.null_block}
        evictable_hits = sum(1 for b in hit_blocks.values() if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            return None
        self._tables[rid] = tables
        self.pool.touch(b for hit in new_computed_blocks for b in hit if b is not self.null_block)
        new_blocks = []
        for g, (table, first) in enumerate(zip(tables, firsts)):
            table.extend(hit[g] for hit in new_computed_blocks)
            passed = [b for b in table[:first] if b is not self.null_block]
            if passed:
                table[:first] = [self.null_block] * min(first, len(table))
                self.pool.free_blocks(passed)
            if len(table) < first:
                table.extend([self.null_block] * (min(first, total) - len(table)))
            fresh = self.pool.get_new_blocks(max(total - len(table), 0))
            table.extend(fresh)
            new_blocks.extend(fresh)
        if not delay_caching:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _tables_of(self, request_id: str) -> list[list[KVCacheBlock]]:
        return self._tables.get(request_id) or []

    def free(self, request: Request) -> None:
        tables = self._tables.pop(request.request_id, None) or []
        self._num_cached.pop(request.request_id, None)
        for table in tables:
            self.pool.free_blocks(b for b in reversed(table) if b is not self.null_block)

    def fits(self, num_tokens: int, chunk_tokens: int) -> bool:
        """A sliding-window group holds at most the window before a chunk and the chunk."""
        bs, n = self.block_size, cdiv(num_tokens, self.block_size)
        need = sum(n if not w else min(n, (w - 1 + chunk_tokens) // bs + 2) for w in self.groups.windows)
        return need <= self.pool.num_blocks - 1  # the null block is never free

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request's tables hold (the null block not counted)."""
        return sum(1 for table in self._tables.get(request_id, ()) for b in table if b is not self.null_block)

    def num_requests(self) -> int:
        return len(self._tables)
