"""Per-request block tables over the block pool, with prefix-cache lookups.

The scheduler asks three things: how much of a new request is already cached
(``get_computed_blocks``), whether there is room for the tokens it wants to compute this step
(``allocate_slots``, None when there is not), and to give a request's blocks back (``free``).
"""

from __future__ import annotations

from pdserve.engine.block_pool import BlockPool, KVCacheBlock
from pdserve.engine.request import Request
from pdserve.prefix_hash import extend_block_hashes, root_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
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

    def update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        if len(request.block_hashes) < len(request.all_token_ids) // self.block_size:
            root = root_hash(self.model_fingerprint, self.block_size, request.cache_salt)
            extend_block_hashes(request.block_hashes, root, request.all_token_ids, self.block_size)

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
        evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - evictable_hits:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(need, 0))
        blocks.extend(new_blocks)
        if not delay_caching:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's full blocks covering its first ``num_tokens`` to prefix hits."""
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        blocks = self._blocks.get(request.request_id, [])
        start = self._num_cached.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Give back the request's blocks; its tail is evicted before its shared prefix."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def num_requests(self) -> int:
        return len(self._blocks)
