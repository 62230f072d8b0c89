"""KVCacheManager: per-request block lists, prefix-cache lookups and slot allocation over the BlockPool."""

from __future__ import annotations

from dataclasses import dataclass

from aioengine.sched.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from aioengine.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache
    requests: int = 0

    def reset(self) -> PrefixCacheStats:
        out = PrefixCacheStats(self.queries, self.hits, self.requests)
        self.queries = self.hits = self.requests = 0
        return out


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()  # since the last take_prefix_cache_stats()
        self.total_prefix_cache = PrefixCacheStats()

    # ---- block hashes -------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to every full block of its known tokens."""
        if not self.enable_caching:
            return
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        extra = (request.cache_salt,) if request.cache_salt is not None else None
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else NONE_HASH
            # The salt only enters the first block: the chain carries it to the rest.
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra if i == 0 else None))

    # ---- lookup and allocation ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, never covering its last token (that one must be computed)."""
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (lookups of requests that did not fit are not counted)."""
        if not self.enable_caching:
            return
        for stats in (self.prefix_cache_stats, self.total_prefix_cache):
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Reserve slots for num_new_tokens after the computed ones; None when the pool cannot fit them.

        Returns the blocks added to the request (cache hits first, then fresh blocks).
        """
        assert num_new_tokens > 0
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            if self.enable_caching:
                self.num_cached_block[rid] = 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        num_required = -(-total_tokens // self.block_size)
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = num_required - len(req_blocks) - num_hits
        if num_new_blocks <= 0 and not num_hits:
            # The common decode case: the current block has room.
            if self.enable_caching and total_tokens // self.block_size > self.num_cached_block[rid]:
                self.cache_blocks(request, total_tokens)
            return []
        num_new_blocks = max(0, num_new_blocks)
        new_computed_blocks = new_computed_blocks or []
        # Cache hits that sit in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[rid]
                self.num_cached_block.pop(rid, None)
            return None
        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Prompt blocks filled by this step can serve hits at once: steps run in order on the device.
            self.cache_blocks(request, total_tokens)
        return new_computed_blocks + new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks holding its first num_tokens tokens (known tokens only)."""
        num_cached = self.num_cached_block.get(request.request_id)
        if num_cached is None or num_tokens // self.block_size <= num_cached:
            return  # not holding blocks, or no new full block
        self.update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request.request_id], request.block_hashes, num_cached, num_full
        )
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a prefix's tail is evicted before its head."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache_stats.reset()
