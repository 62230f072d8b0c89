"""The KV block pool: blocks, their ref counts, an O(1) LRU free queue and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aioengine.sched.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from aioengine.sched.kv_offload import OffloadTier

NONE_HASH = 0


def hash_block_tokens(
    parent_hash: int, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] | None = None
) -> int:
    """Chained block hash: equal hashes mean equal token prefixes (and extra keys, e.g. a cache salt).

    Made of ints and tuples only, so a hash means the same in another process (a disk tier's block files
    outlive the server); ``hash(None)`` is an address before Python 3.12."""
    return hash((parent_hash, tuple(token_ids), extra_keys or ()))


def chain_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of ``token_ids``, as the KV cache manager makes them for a
    request with no cache salt or adapter (a router outside the engine scores replicas by them)."""
    hashes: list[int] = []
    parent = NONE_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set while the block holds a full, cached block of tokens
    cache_group: int = 0  # the KV cache group it is cached for (sched/kv_cache_spec.py)
    # its tokens, kept only for a disk tier (a block file names them); None: it may not go to disk
    token_ids: tuple[int, ...] | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Intrusive doubly linked list of free blocks, least recently freed first.

    The links live in the blocks themselves, so append, popleft and remove from the middle
    (a cache hit on a free block) are all O(1) with no allocation.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        assert block is not None and block is not self._tail, "no free blocks"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free_block


class BlockPool:
    """Owns every KV block. Block 0 is the null block, never handed out (a placeholder in block tables)."""

    def __init__(
        self, num_blocks: int, record_events: bool = False, offload: OffloadTier | None = None
    ) -> None:
        """``record_events``: keep the prefix cache's changes for ``take_events`` (KV events on);
        ``offload``: the second tier that evicted blocks go to."""
        assert num_blocks >= 2, "need at least one usable block besides the null block"
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # (block hash, group) -> block: each group caches its own copy of a token block's KV
        self.cached_block_hash_to_block: dict[tuple[int, int], KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.events: list[KVEvent] | None = [] if record_events else None
        self.offload = offload
        self.keep_tokens = offload is not None and offload.disk is not None

    def take_events(self) -> list[KVEvent]:
        """The changes since the last call (none when not recording)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM's reset: only while no request holds a block (else False)."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self.cached_block_hash_to_block.clear()
        if self.offload is not None:
            self.offload.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (free-but-cached blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def cached_hashes(self, group: int = 0, limit: int | None = None) -> list[int]:
        """The hashes of the group's cached blocks, the most recently cached first (at most ``limit``)."""
        out = []
        for h, g in reversed(self.cached_block_hash_to_block):  # a dict keeps its insertion order
            if g == group:
                out.append(h)
                if len(out) == limit:
                    break
        return out

    def get_cached_block(self, block_hash: int, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get((block_hash, group))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.get_num_free_blocks(), "not enough free blocks"
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)  # lazy eviction: a free block keeps its cached KV until reused
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            key = (block.block_hash, block.cache_group)
            if self.cached_block_hash_to_block.get(key) is block:
                del self.cached_block_hash_to_block[key]
                if self.offload is not None:  # copied out before this step's forward writes it again
                    self.offload.offload(block.block_id, key, block.token_ids)
                if self.events is not None:
                    self.events.append(BlockRemoved([block.block_hash], block.cache_group))
            block.block_hash = None
            block.token_ids = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in given order (evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[int],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
        lora_id: int | None = None,
    ) -> None:
        """Publish blocks [num_cached_blocks, num_full_blocks) of a request under their chained hashes
        (``token_ids``, ``block_size``, ``lora_id``: the request's, for the events)."""
        stored: BlockStored | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:  # a hit (already published), or none held
                continue
            h = block_hashes[i]
            block.block_hash, block.cache_group = h, group
            # Keep the first block published under a hash; a duplicate stays private to its request.
            if self.cached_block_hash_to_block.setdefault((h, group), block) is not block:
                continue
            if self.keep_tokens and not lora_id:  # an adapter's id means nothing to another process
                block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
            if self.events is None:
                continue
            tokens = list(token_ids[i * block_size : (i + 1) * block_size])
            if stored is not None and stored.block_hashes[-1] == block_hashes[i - 1]:  # the chain goes on
                stored.block_hashes.append(h)
                stored.token_ids += tokens
                continue
            parent = block_hashes[i - 1] if i else None
            stored = BlockStored([h], parent, tokens, block_size, lora_id, group)
            self.events.append(stored)
