"""KVCacheManager: per-request block lists (one per KV cache group), prefix-cache lookups and slot allocation
over the one BlockPool.

With a sliding-window group (sched/kv_cache_spec.py) it is vLLM's hybrid manager: a windowed group frees the
blocks that fall out of every future token's window (the null block takes their place in the request's
list), so a request holds at most ``cdiv(window - 1 + tokens scheduled in a step, block_size) + 1`` blocks
in each windowed group, however long it grows; a full-attention group keeps every block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from aioengine.sched.block_pool import NONE_HASH, BlockPool, KVCacheBlock, hash_block_tokens
from aioengine.sched.kv_cache_spec import KVCacheGroup
from aioengine.sched.kv_offload import OffloadTier
from aioengine.sched.request import Request

GroupBlocks = list[list[KVCacheBlock]]  # one block list per KV cache group
# A lookup's hit: a pool block, or None for a block the host tier holds (loaded into a fresh block)
HitBlocks = list[list[KVCacheBlock | None]]
FULL = (KVCacheGroup((0,), None),)  # one full-attention group (the layer list does not matter here)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    def reset(self) -> PrefixCacheStats:
        out = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return out


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        groups: tuple[KVCacheGroup, ...] = FULL,
        kv_events: bool = False,
        offload: OffloadTier | None = None,
    ) -> None:
        """``kv_events``: the block pool records the prefix cache's changes (``block_pool.take_events``);
        ``offload``: a second tier (host slots, maybe disk) for blocks the pool evicts."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.groups = groups
        self.offload = offload if enable_caching else None
        self.block_pool = BlockPool(num_blocks, kv_events and enable_caching, self.offload)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        self.num_cached_block: dict[str, list[int]] = {}
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
        # A hit never crosses cache salts or LoRA adapters (their KV differs for the same tokens). The salt
        # enters as a digest: a string's hash() changes from one process to the next.
        salt = request.cache_salt
        extra = None
        if salt is not None or request.lora_id:
            digest = -1
            if salt is not None:
                digest = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")
            extra = (digest, request.lora_id)
        for i in range(len(hashes), len(tokens) // bs):
            parent = hashes[-1] if hashes else NONE_HASH
            # The extra keys only enter the first block: the chain carries them to the rest.
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra if i == 0 else None))

    # ---- lookup and allocation ----------------------------------------------------------------
    def _hit_length(self, hashes: list[int], n: int, present: Callable[[int, int], bool]) -> int:
        """The longest prefix of at most ``n`` blocks every group can serve, ``present(hash, group)`` saying
        which blocks exist: a full group needs every block of it; a windowed group only those the next
        token's window reaches."""
        bs = self.block_size
        for g, group in enumerate(self.groups):
            if group.sliding_window is None:  # prefix-closed: walk from the start
                k = 0
                while k < n and present(hashes[k], g):
                    k += 1
                n = k
        changed = True
        while changed:  # each windowed group may shorten the hit; the others then check again
            changed = False
            for g, group in enumerate(self.groups):
                if group.sliding_window is None:
                    continue
                k = n
                while k > 0:
                    first = group.blocks_needed_from(k * bs, bs)
                    missing = [i for i in range(first, k) if not present(hashes[i], g)]
                    if not missing:
                        break
                    k = missing[-1]  # a hit ending at or before the last missing block
                if k < n:
                    n, changed = k, True
        return n

    def _resident(self, block_hash: int, group: int) -> bool:
        """In the pool, or in the host tier (a copy away)."""
        if self.block_pool.get_cached_block(block_hash, group) is not None:
            return True
        return self.offload is not None and self.offload.in_host((block_hash, group))

    def get_computed_blocks(self, request: Request) -> tuple[HitBlocks, int]:
        """Longest cached prefix of the request, never covering its last token (that one must be computed):
        pool blocks, and None where the host tier holds the block (``allocate_slots`` loads it)."""
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        pool, bs, hashes = self.block_pool, self.block_size, request.block_hashes
        n = min((request.num_tokens - 1) // bs, len(hashes))
        n = self._hit_length(hashes, n, self._resident)
        if n == 0:
            return [], 0
        out: HitBlocks = []
        for g, group in enumerate(self.groups):
            first = group.blocks_needed_from(n * bs, bs)
            blocks: list[KVCacheBlock | None] = [pool.null_block] * first
            for i in range(first, n):
                blocks.append(pool.get_cached_block(hashes[i], g))  # None: in the host tier
            out.append(blocks)
        return out, n * bs

    def read_from_disk(self, request: Request, num_hit_tokens: int) -> bool:
        """Past a hit of ``num_hit_tokens``, the blocks only the disk tier holds: start reading them into
        host slots, once a request (as many as the slots take, in chain order). True: the request waits
        for its reads (its next lookup then hits the host tier)."""
        tier = self.offload
        if tier is None or tier.disk is None or not len(tier.disk) + len(tier.arriving):
            return False
        bs, hashes = self.block_size, request.block_hashes
        n = min((request.num_tokens - 1) // bs, len(hashes))
        if n * bs <= num_hit_tokens:
            return False

        def present(h: int, g: int) -> bool:
            return self._resident(h, g) or tier.on_disk((h, g))

        n = self._hit_length(hashes, n, present)
        if n * bs <= num_hit_tokens:
            return False
        needed = [
            (i, (hashes[i], g))
            for g, group in enumerate(self.groups)
            for i in range(group.blocks_needed_from(n * bs, bs), n)
            if not self._resident(hashes[i], g)
        ]
        needed.sort()  # chain order: a partial read still extends the hit
        waits = any(key in tier.arriving for _, key in needed)
        if request.kv_disk_rounds:  # one round a request: reads evicted before its turn are computed
            return waits
        keep = frozenset((hashes[i], g) for g in range(len(self.groups)) for i in range(n))
        tokens = request.all_token_ids
        for i, key in needed:
            if key in tier.arriving:
                continue
            if not tier.read(key, tuple(tokens[i * bs : (i + 1) * bs]), keep):
                break  # no slot left to read into
            request.kv_disk_rounds = 1
            request.kv_disk_keys.append(key)
            waits = True
        tier.want(request.kv_disk_keys)
        return waits

    def release_disk_reads(self, request: Request) -> None:
        """The request went (admitted or finished): the blocks read for it stop being held."""
        if request.kv_disk_keys and self.offload is not None:
            self.offload.unwant(request.kv_disk_keys)
        request.kv_disk_keys = []

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (lookups of requests that did not fit are not counted)."""
        if not self.enable_caching:
            return
        for stats in (self.prefix_cache_stats, self.total_prefix_cache):
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free windowed groups' blocks no future token of the request attends to (null in their place)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            return
        null = self.block_pool.null_block
        for group, blocks in zip(self.groups, req_blocks, strict=True):
            first = min(group.blocks_needed_from(request.num_computed_tokens, self.block_size), len(blocks))
            freed = []
            for i in range(first - 1, -1, -1):  # newest first: the walk stops at the previous frontier
                if blocks[i] is null:
                    break
                freed.append(blocks[i])
                blocks[i] = null
            if freed:
                self.block_pool.free_blocks(freed)  # each keeps its hash (evictable) until reused

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: HitBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> GroupBlocks | None:
        """Reserve slots for num_new_tokens after the computed ones, in every group; None when the pool cannot
        fit them. ``num_lookahead_tokens`` more slots are reserved past them (a draft model writes its
        proposals' KV there before the target schedules those positions).

        Returns the blocks added to the request in each group (cache hits first, then fresh blocks).
        """
        assert num_new_tokens > 0
        rid = request.request_id
        num_groups = len(self.groups)
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = [[] for _ in range(num_groups)]
            if self.enable_caching:
                self.num_cached_block[rid] = [0] * num_groups
        else:
            self.remove_skipped_blocks(request)
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = min(num_computed + num_new_tokens, self.max_model_len)
        num_required = cdiv(min(total_tokens + num_lookahead_tokens, self.max_model_len), self.block_size)
        hits = new_computed_blocks or [[] for _ in range(num_groups)]
        num_new = [max(0, num_required - len(req_blocks[g]) - len(hits[g])) for g in range(num_groups)]
        if not any(num_new) and not any(hits):
            # The common decode case: the current block has room.
            if self.enable_caching:
                self.cache_blocks(request, total_tokens)
            return [[] for _ in range(num_groups)]
        # Cache hits that sit in the free queue stop being free once touched.
        touched = [b for blocks in hits for b in blocks if b is not None and not b.is_null]
        num_evictable_hits = sum(1 for b in touched if b.ref_cnt == 0)
        loads = [(g, i) for g, blocks in enumerate(hits) for i, b in enumerate(blocks) if b is None]
        if sum(num_new) + len(loads) > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not any(req_blocks):
                del self.req_to_blocks[rid]
                self.num_cached_block.pop(rid, None)
            return None
        self.block_pool.touch(touched)
        if loads:  # the host tier's blocks, into fresh pool blocks (pinned first: evictions store meanwhile)
            tier = self.offload
            assert tier is not None
            keys = [(request.block_hashes[i], g) for g, i in loads]
            tier.pin(keys)
            for (g, i), key in zip(loads, keys, strict=True):
                block = self.block_pool.get_new_blocks(1)[0]
                tier.load(key, block.block_id)
                hits[g][i] = block
            # prompt tokens: a position loaded in several groups counts once
            tier.stats.host_hit_tokens += len({i for _, i in loads}) * self.block_size
        out: GroupBlocks = []
        for g in range(num_groups):
            new_blocks = self.block_pool.get_new_blocks(num_new[g])
            group_hits = [b for b in hits[g] if b is not None]
            req_blocks[g].extend(group_hits)
            req_blocks[g].extend(new_blocks)
            out.append(group_hits + new_blocks)
        if self.enable_caching:
            # Prompt blocks filled by this step can serve hits at once: steps run in order on the device.
            self.cache_blocks(request, total_tokens)
        return out

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks holding its first num_tokens tokens (known tokens only)."""
        num_cached = self.num_cached_block.get(request.request_id)
        if num_cached is None or num_tokens // self.block_size <= min(num_cached):
            return  # not holding blocks, or no new full block
        self.update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        req_blocks = self.req_to_blocks[request.request_id]
        for g in range(len(self.groups)):
            if num_full > num_cached[g]:
                self.block_pool.cache_full_blocks(
                    req_blocks[g],
                    request.block_hashes,
                    num_cached[g],
                    num_full,
                    g,
                    request.all_token_ids,
                    self.block_size,
                    request.lora_id or None,
                )
                num_cached[g] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a prefix's tail is evicted before its head."""
        req_blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        for blocks in req_blocks or ():
            self.block_pool.free_blocks(b for b in reversed(blocks) if not b.is_null)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids in each group (the null block's id where a window let a block go)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in g] for g in blocks)

    def num_blocks_held(self, request_id: str, group: int) -> int:
        """Blocks the request holds in a group (nulls excluded)."""
        return sum(
            1 for b in self.req_to_blocks.get(request_id, [[]] * len(self.groups))[group] if not b.is_null
        )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        return self.prefix_cache_stats.reset()
