"""The bookkeeping of the prefix cache's second tier: host slots, the disk index, and each step's copies.

It says which evicted blocks a host tier (and a disk tier) holds, in which host slot, and which copies
each step carries out on the worker (SchedulerOutput.kv_transfers). A block leaving the KV pool (reused
for other tokens) is copied to a host slot first; a later lookup that runs past the pool's hits continues
in the host tier, and those blocks are copied back into fresh pool blocks before the step's forward. The
worker runs a step's stores before its loads, and steps run in order, so a slot's bytes are always the
ones its entry names. With a disk tier every stored block is also written to a file; a block found only on
disk is read by the engine (off the step) into a reserved slot, and its request waits until then, so a
corrupt file costs a recompute, never a wrong hit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

Key = tuple[int, int]  # (chained block hash, KV cache group)


@dataclass(slots=True)
class KVTransfers:
    """One step's tier copies, run on every rank before the forward: disk writes straight from the pool,
    block files past the cap deleted, stores (and their disk writes), then loads."""

    stores: list[tuple[int, int]] = field(default_factory=list)  # (pool block id, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, pool block id)
    # Stored blocks that also go to disk: (index in stores, block hash, group, the block's token ids).
    writes: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    # Evicted blocks no slot could take, written to disk straight from the pool (before anything else):
    # (pool block id, block hash, group, token ids).
    pool_writes: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    disk_deletes: list[Key] = field(default_factory=list)  # block files past the disk tier's cap (oldest)

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.pool_writes or self.disk_deletes)


@dataclass(slots=True)
class DiskRead:
    """A block the engine reads from disk into ``slot``; ``token_ids`` must match the file's."""

    key: Key
    slot: int
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class OffloadStats:
    stored_blocks: int = 0  # copied from the pool to the host tier
    host_hit_tokens: int = 0  # prompt tokens loaded back from the host tier (a disk read lands there first)
    disk_read_blocks: int = 0  # blocks read back from disk into host slots (one per KV cache group)
    disk_reads_failed: int = 0  # missing, truncated or corrupt files: recomputed
    dropped_blocks: int = 0  # evicted with no slot free to take them (every slot pinned)


class OffloadTier:
    """Host slots in LRU order, the disk tier's index, and the transfers of the step being planned."""

    def __init__(
        self,
        num_slots: int,
        disk_index: list[Key] | None = None,
        block_size: int = 16,
        disk_blocks: int = 0,
    ) -> None:
        """``disk_index``: the keys already on disk, oldest first (a restart finds them); None: no disk tier.
        ``disk_blocks``: the most block files kept (the least recently used go first); 0: no cap."""
        assert num_slots >= 1
        self.block_size = block_size
        self.host: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.pinned: dict[int, int] = {}  # slot -> pins: a load of this step, or a disk read under way
        self.disk: OrderedDict[Key, None] | None = (
            None if disk_index is None else OrderedDict.fromkeys(disk_index)
        )
        self.arriving: dict[Key, int] = {}  # disk reads under way -> their reserved slot
        # In the index, not yet handed to the writer: the step that writes them has not run. A read asked
        # now could pass the write on the I/O thread, so lookups do not count them as on disk yet.
        self.unwritten: set[Key] = set()
        # Blocks read for requests still waiting (how many want each), and those of them landed and held
        # pinned until their requests go: a landed block evicted before its turn would be read again.
        self.wanted: dict[Key, int] = {}
        self.held: set[Key] = set()
        self.transfers = KVTransfers()
        self.reads: list[DiskRead] = []  # started this step, for the engine
        self._step_pins: list[int] = []
        self.stats = OffloadStats()  # since start
        self.disk_blocks = disk_blocks
        self._cap_disk()

    # ---- lookups -------------------------------------------------------------------------------
    def in_host(self, key: Key) -> bool:
        return key in self.host

    def on_disk(self, key: Key) -> bool:
        if key in self.arriving:
            return True
        return self.disk is not None and key in self.disk and key not in self.unwritten

    @property
    def waiting_on_disk(self) -> bool:
        return bool(self.arriving)

    # ---- pool -> host ----------------------------------------------------------------------------
    def offload(self, block_id: int, key: Key, token_ids: tuple[int, ...] | None) -> None:
        """A cached block leaves the pool: keep its KV in a host slot (and on disk when ``token_ids`` is
        given: only blocks whose hash means the same after a restart go there)."""
        self._used_on_disk(key)
        if key in self.host:
            self.host.move_to_end(key)  # the same KV is held already
            return
        slot = self._take_slot()
        to_disk = self.disk is not None and token_ids is not None and key not in self.disk
        if slot is None:  # every slot is pinned by this step's loads or by reads under way
            if to_disk:
                assert token_ids is not None
                self.transfers.pool_writes.append((block_id, key[0], key[1], token_ids))
                self._on_disk(key)
            elif self.disk is None or key not in self.disk:
                self.stats.dropped_blocks += 1
            return
        self.host[key] = slot
        self.transfers.stores.append((block_id, slot))
        self.stats.stored_blocks += 1
        if to_disk:
            assert token_ids is not None
            self.transfers.writes.append((len(self.transfers.stores) - 1, key[0], key[1], token_ids))
            self._on_disk(key)

    def _used_on_disk(self, key: Key) -> None:
        """The block was used (hit, evicted again): its file is the last to go past the cap."""
        if self.disk is not None and key in self.disk:
            self.disk.move_to_end(key)

    def _on_disk(self, key: Key) -> None:
        assert self.disk is not None
        self.disk[key] = None
        self.unwritten.add(key)
        deletes = self.transfers.disk_deletes
        if key in deletes:  # dropped past the cap earlier in this step: written again instead
            deletes.remove(key)
        self._cap_disk()

    def written(self, transfers: KVTransfers) -> None:
        """The step carrying these transfers ran: its blocks are queued on the I/O thread, ahead of any read
        asked from now on."""
        for _, block_hash, group, _ in transfers.writes:
            self.unwritten.discard((block_hash, group))
        for _, block_hash, group, _ in transfers.pool_writes:
            self.unwritten.discard((block_hash, group))

    def _cap_disk(self) -> None:
        """Past the cap, the least recently used block files go (none a read is under way for)."""
        disk = self.disk
        if disk is None or not self.disk_blocks:
            return
        while len(disk) > self.disk_blocks:
            old = next((k for k in disk if k not in self.arriving), None)
            if old is None:
                return
            del disk[old]
            self.unwritten.discard(old)
            # A write of it planned in this step is dropped (the worker runs deletes between the pool's
            # writes and the stores' writes); a file from an earlier step is deleted.
            t = self.transfers
            t.writes = [w for w in t.writes if w[1:3] != old]
            t.pool_writes = [w for w in t.pool_writes if w[1:3] != old]
            t.disk_deletes.append(old)

    def _take_slot(self, keep: frozenset[Key] = frozenset()) -> int | None:
        """A free slot, else the least recently used entry's that is neither pinned nor in ``keep``."""
        if self.free_slots:
            return self.free_slots.pop()
        for key, slot in self.host.items():
            if slot not in self.pinned and key not in keep:
                del self.host[key]
                return slot
        return None

    def _pin(self, slot: int) -> None:
        self.pinned[slot] = self.pinned.get(slot, 0) + 1

    def _unpin(self, slot: int) -> None:
        left = self.pinned[slot] - 1
        if left:
            self.pinned[slot] = left
        else:
            del self.pinned[slot]

    # ---- host -> pool ----------------------------------------------------------------------------
    def pin(self, keys: list[Key]) -> None:
        """Hold these host entries for this step's loads (no store may take their slots)."""
        for key in keys:
            slot = self.host[key]
            self._pin(slot)
            self._step_pins.append(slot)

    def load(self, key: Key, block_id: int) -> None:
        """Copy a (pinned) host entry into a fresh pool block before the forward."""
        slot = self.host[key]
        self.host.move_to_end(key)
        self._used_on_disk(key)
        self.transfers.loads.append((slot, block_id))

    # ---- disk -> host ----------------------------------------------------------------------------
    def read(self, key: Key, token_ids: tuple[int, ...], keep: frozenset[Key] = frozenset()) -> bool:
        """Start reading a block found only on disk into a slot reserved for it, evicting no entry in
        ``keep`` (the request's own hits) for it (False: no slot to take)."""
        assert key not in self.arriving
        slot = self._take_slot(keep)
        if slot is None:
            return False
        self._used_on_disk(key)
        self._pin(slot)
        self.arriving[key] = slot
        self.reads.append(DiskRead(key, slot, token_ids))
        return True

    def read_done(self, key: Key, ok: bool) -> None:
        """The engine finished a read: the block is in its slot, or the file was bad (it is forgotten, and
        the tokens are computed again)."""
        slot = self.arriving.pop(key)
        if ok and key in self.host:  # stored again meanwhile (computed anew, then evicted)
            self._unpin(slot)
            self.free_slots.append(slot)
            if key in self.wanted and key not in self.held:  # hold that copy instead
                self._pin(self.host[key])
                self.held.add(key)
        elif ok:
            self.host[key] = slot
            self.stats.disk_read_blocks += 1
            if key in self.wanted:
                self.held.add(key)  # its read's pin stays until the requests wanting it go
            else:
                self._unpin(slot)
        else:
            self._unpin(slot)
            self.free_slots.append(slot)
            self.stats.disk_reads_failed += 1
            if self.disk is not None:
                self.disk.pop(key, None)
                self.unwritten.discard(key)

    def want(self, keys: list[Key]) -> None:
        """A waiting request needs these blocks read (its lookup runs again once they land)."""
        for key in keys:
            self.wanted[key] = self.wanted.get(key, 0) + 1

    def unwant(self, keys: list[Key]) -> None:
        """That request went (admitted, with its loads pinned for the step, or finished)."""
        for key in keys:
            left = self.wanted.get(key, 0) - 1
            if left > 0:
                self.wanted[key] = left
                continue
            self.wanted.pop(key, None)
            if key in self.held:
                self.held.discard(key)
                self._unpin(self.host[key])

    # ---- per step --------------------------------------------------------------------------------
    def take_transfers(self) -> KVTransfers | None:
        """The step's copies (None: none), and the end of its pins."""
        for slot in self._step_pins:
            self._unpin(slot)
        self._step_pins = []
        out, self.transfers = self.transfers, KVTransfers()
        return out if out else None

    def take_reads(self) -> list[DiskRead]:
        out, self.reads = self.reads, []
        return out

    def clear(self) -> None:
        """Forget every entry (the prefix cache's reset); reads under way keep their slots until done."""
        for key in self.held:
            self._unpin(self.host[key])
        self.held.clear()
        for slot in self.host.values():
            self.free_slots.append(slot)
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        self.unwritten.clear()
