"""The KV offload tier's host slots, and the copies a step's KVTransfers ask for, run before its forward."""

from __future__ import annotations

from collections.abc import Callable

import torch

from aioengine.sched.kv_offload import KVTransfers

# (block hash, group, the block's token ids, its bytes): a block for the disk tier, handed over as bytes
DiskWrite = Callable[[int, int, tuple[int, ...], bytes], None]
HostBuffer = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class HostKVTier:
    """Slots of one block of every KV cache tensor each, in host memory; the pool's blocks copy to and from
    them by block id, and a slot's bytes (every tensor's part in turn) are what the disk tier stores."""

    def __init__(self, caches: list[torch.Tensor], num_slots: int, host_buffer: HostBuffer) -> None:
        """``caches``: every KV tensor a block id addresses (``[2, blocks, ...]`` each, the draft model's
        included); ``host_buffer``: the backend's host memory (pinned on CUDA)."""
        self.caches = caches
        self.slots = [host_buffer((num_slots, *c[:, 0].shape), c.dtype) for c in caches]
        self.host = self.slots[0].device
        self.block_bytes = sum(s[0].numel() * s.element_size() for s in self.slots)
        self.disk_write: DiskWrite | None = None  # set by the engine when a disk tier exists
        self.disk_delete: Callable[[int, int], None] | None = None  # (block hash, group): a file past the cap

    def run(self, transfers: KVTransfers) -> None:
        """Disk writes straight from the pool, stores, then loads: a block evicted in this step may be the
        one a load fills."""
        if self.disk_write is not None:
            for block_id, block_hash, group, token_ids in transfers.pool_writes:
                self.disk_write(block_hash, group, token_ids, self.block_bytes_of(block_id))
        if self.disk_delete is not None:
            for block_hash, group in transfers.disk_deletes:
                self.disk_delete(block_hash, group)
        stores, writes = transfers.stores, transfers.writes
        if stores:
            slots = [s for _, s in stores]
            if len(set(slots)) == len(slots):
                self._store([b for b, _ in stores], slots)
                self._write(writes, slots)
            else:  # a slot taken twice in one step (a tier smaller than a step's evictions): in order
                for i, (block_id, slot) in enumerate(stores):
                    self._store([block_id], [slot])
                    self._write([w for w in writes if w[0] == i], slots)
        if transfers.loads:
            ids = torch.tensor([b for _, b in transfers.loads])
            slot_ids = torch.tensor([s for s, _ in transfers.loads])
            for cache, host in zip(self.caches, self.slots, strict=True):
                rows = host.index_select(0, slot_ids).transpose(0, 1)
                cache.index_copy_(1, ids.to(cache.device), rows.to(cache.device, non_blocking=True))

    def _store(self, block_ids: list[int], slots: list[int]) -> None:
        ids = torch.tensor(block_ids)
        slot_ids = torch.tensor(slots)
        for cache, host in zip(self.caches, self.slots, strict=True):
            rows = cache.index_select(1, ids.to(cache.device)).transpose(0, 1)
            host.index_copy_(0, slot_ids, rows.to(self.host))

    def _write(self, writes: list[tuple[int, int, int, tuple[int, ...]]], slots: list[int]) -> None:
        """Hand each stored block bound for disk to the writer as bytes (it writes behind the steps)."""
        if self.disk_write is None:
            return
        for store, block_hash, group, token_ids in writes:
            self.disk_write(block_hash, group, token_ids, self.slot_bytes(slots[store]))

    def _bytes(self, parts: list[torch.Tensor]) -> bytes:
        return b"".join(p.to(self.host).contiguous().view(torch.uint8).numpy().tobytes() for p in parts)

    def block_bytes_of(self, block_id: int) -> bytes:
        """A pool block's bytes, laid out as a slot's."""
        return self._bytes([c[:, block_id] for c in self.caches])

    def slot_bytes(self, slot: int) -> bytes:
        return self._bytes([h[slot] for h in self.slots])

    def fill(self, slot: int, payload: bytes) -> None:
        """A block read from disk, into its slot (the tier reserved the slot for it)."""
        assert len(payload) == self.block_bytes, "the disk tier checks the size"
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for host in self.slots:
            n = host[slot].numel() * host.element_size()
            host[slot].view(torch.uint8).view(-1).copy_(data[at : at + n])
            at += n
