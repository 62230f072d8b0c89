"""The offload tier's bookkeeping, through the KV cache manager: evicted blocks go to host slots (LRU), a
later lookup runs on into the host tier and loads into fresh blocks, a step's loads pin their slots, a
disk-only run is read once into reserved slots, and a failed read is forgotten."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import subprocess
import sys

from aioengine.sampling_params import SamplingParams
from aioengine.sched.kv_cache_manager import KVCacheManager
from aioengine.sched.kv_offload import OffloadTier
from aioengine.sched.request import Request

BS = 4


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def _fill(kv: KVCacheManager, req: Request) -> None:
    """Admit the request's whole prompt (its full blocks are cached), then finish it."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    kv.free(req)


def test_evicted_blocks_come_back_from_the_host_tier():
    tier = OffloadTier(num_slots=8, block_size=BS)
    kv = KVCacheManager(num_blocks=1 + 4, block_size=BS, max_model_len=64, offload=tier)
    a = list(range(100, 113))  # 3 full blocks and one token
    _fill(kv, _req("a", a))
    assert tier.take_transfers() is None  # nothing evicted yet
    _fill(kv, _req("b", list(range(200, 213))))  # takes the pool's blocks: a's 3 go to the host tier
    moved = tier.take_transfers()
    assert moved is not None and len(moved.stores) == 3 and not moved.loads
    assert sorted(s for _, s in moved.stores) == [0, 1, 2] and len(tier.host) == 3

    again = _req("a2", a)
    hits, n = kv.get_computed_blocks(again)
    assert n == 12 and all(b is None for b in hits[0])  # all three in the host tier
    new = kv.allocate_slots(again, 1, n, hits)
    assert new is not None and len(new[0]) == 4
    step = tier.take_transfers()
    assert step is not None and [b for _, b in step.loads] == [b.block_id for b in new[0][:3]]
    assert tier.stats.host_hit_tokens == 12
    assert not tier.pinned  # the step's pins end with its transfers
    # loaded blocks are the pool's again: the next lookup finds them there
    found = kv.get_computed_blocks(_req("a3", a))[0][0]
    assert [b.block_id for b in found] == [b.block_id for b in new[0][:3]]


def test_a_tier_hit_never_crosses_cache_salts():
    tier = OffloadTier(num_slots=8, block_size=BS)
    kv = KVCacheManager(num_blocks=1 + 4, block_size=BS, max_model_len=64, offload=tier)
    a = list(range(100, 113))
    _fill(kv, _req("a", a, salt="tenant-1"))
    _fill(kv, _req("b", list(range(200, 213))))  # a's blocks go to the host tier
    assert len(tier.host) == 3
    assert kv.get_computed_blocks(_req("a2", a, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(_req("a3", a))[1] == 0
    assert kv.get_computed_blocks(_req("a4", a, salt="tenant-1"))[1] == 12


def test_a_steps_loads_pin_their_slots_and_lru_evicts_the_oldest():
    tier = OffloadTier(num_slots=2, block_size=BS)
    tier.offload(5, (1, 0), None)
    tier.offload(6, (2, 0), None)
    tier.take_transfers()
    tier.pin([(1, 0)])
    tier.load((1, 0), 9)
    tier.offload(7, (3, 0), None)  # (1, 0) is pinned: (2, 0), the other, goes
    assert list(tier.host) == [(1, 0), (3, 0)]
    step = tier.take_transfers()
    assert step is not None and step.stores == [(7, 1)] and step.loads == [(0, 9)]
    tier.offload(8, (4, 0), None)  # unpinned now: the least recently used goes
    assert list(tier.host) == [(3, 0), (4, 0)]
    tier.pin([(3, 0)])
    tier.pin([(4, 0)])
    tier.offload(9, (5, 0), None)  # every slot pinned, no disk: dropped
    assert tier.stats.dropped_blocks == 1 and (5, 0) not in tier.host


def test_disk_blocks_are_read_once_and_a_failed_read_is_forgotten():
    a = list(range(100, 117))  # 4 full blocks
    req = _req("a", a)
    probe = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    probe.update_block_hashes(req)
    keys = [(h, 0) for h in req.block_hashes]
    tier = OffloadTier(num_slots=3, disk_index=keys, block_size=BS)
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64, offload=tier)
    req = _req("a", a)
    assert kv.get_computed_blocks(req) == ([], 0)
    assert kv.read_from_disk(req, 0)  # waits: three slots, so the first three blocks in chain order
    reads = tier.take_reads()
    assert [r.key for r in reads] == keys[:3] and [r.token_ids for r in reads] == [
        tuple(a[i * BS : (i + 1) * BS]) for i in range(3)
    ]
    assert kv.read_from_disk(req, 0)  # still under way
    assert not tier.take_reads()
    tier.read_done(keys[0], True)
    tier.read_done(keys[1], True)
    tier.read_done(keys[2], False)  # a bad file: forgotten, its slot free again
    assert keys[2] not in tier.disk and tier.stats.disk_reads_failed == 1
    assert not kv.read_from_disk(req, 8)  # one round a request: it goes with what is in
    hits, n = kv.get_computed_blocks(req)
    assert n == 8 and hits == [[None, None]]
    assert tier.stats.disk_read_blocks == 2
    # landed blocks stay pinned while their request waits: no store evicts them before its turn
    assert set(tier.pinned) == {tier.host[k] for k in keys[:2]}
    tier.offload(7, (77, 0), None)  # the free slot
    tier.offload(8, (78, 0), None)  # evicts (77, 0), not the held ones
    assert list(tier.host) == [keys[0], keys[1], (78, 0)]
    kv.release_disk_reads(req)  # admitted (or gone)
    assert not tier.pinned and req.kv_disk_keys == []


def test_a_read_landing_after_its_block_was_stored_again_frees_its_slot():
    tier = OffloadTier(num_slots=2, disk_index=[(1, 0)], block_size=BS)
    assert tier.read((1, 0), (1, 2, 3, 4))
    tier.offload(7, (1, 0), None)  # computed anew and evicted while the read was under way
    tier.read_done((1, 0), True)
    assert len(tier.host) == 1 and len(tier.free_slots) == 1 and not tier.pinned


def test_the_disk_tier_keeps_its_cap_dropping_the_least_recently_used():
    tier = OffloadTier(num_slots=4, disk_index=[(1, 0), (2, 0), (3, 0)], block_size=BS, disk_blocks=2)
    first = tier.take_transfers()  # the folder held more than the cap at start: the oldest goes
    assert first is not None and first.disk_deletes == [(1, 0)] and list(tier.disk) == [(2, 0), (3, 0)]
    assert tier.read((2, 0), (1, 2, 3, 4))  # used: now the most recent
    tier.offload(5, (4, 0), (5, 6, 7, 8))
    step = tier.take_transfers()
    assert step is not None and step.disk_deletes == [(3, 0)] and list(tier.disk) == [(2, 0), (4, 0)]
    tier.offload(6, (6, 0), (9, 9, 9, 9))  # (2, 0) is being read: (4, 0) goes instead
    step = tier.take_transfers()
    assert step is not None and step.disk_deletes == [(4, 0)] and list(tier.disk) == [(2, 0), (6, 0)]


def test_a_write_and_a_delete_of_one_block_in_one_step_never_cross():
    """The worker runs deletes between the pool's writes and the stores' writes: the tier keeps at most one
    of the two for a block in a step."""
    tier = OffloadTier(num_slots=8, disk_index=[], block_size=BS, disk_blocks=1)
    tier.offload(1, (1, 0), (1, 1, 1, 1))
    tier.offload(2, (2, 0), (2, 2, 2, 2))  # past the cap: (1, 0) goes, its planned write with it
    step = tier.take_transfers()
    assert step is not None and [w[1:3] for w in step.writes] == [(2, 0)] and step.disk_deletes == [(1, 0)]
    assert list(tier.disk) == [(2, 0)]
    tier.written(step)
    tier.host.clear()
    tier.free_slots = []  # no slot: the next evictions write straight from the pool
    tier.offload(3, (3, 0), (3, 3, 3, 3))  # drops (2, 0): a delete
    tier.offload(4, (2, 0), (2, 2, 2, 2))  # (2, 0) again: written anew, the delete withdrawn; (3, 0) goes
    step = tier.take_transfers()
    assert step is not None and [w[1:3] for w in step.pool_writes] == [(2, 0)]
    assert step.disk_deletes == [(3, 0)] and list(tier.disk) == [(2, 0)]


def test_a_hit_keeps_a_block_file_from_the_cap():
    tier = OffloadTier(num_slots=8, disk_index=[(1, 0), (2, 0)], block_size=BS, disk_blocks=2)
    tier.offload(5, (1, 0), (1, 1, 1, 1))  # evicted from the pool again: used
    tier.offload(6, (3, 0), (3, 3, 3, 3))
    step = tier.take_transfers()
    assert step is not None and step.disk_deletes == [(2, 0)] and list(tier.disk) == [(1, 0), (3, 0)]


def test_a_block_counts_as_on_disk_once_the_step_writing_it_ran():
    """Else a read asked right away could reach the I/O thread before the write it needs."""
    tier = OffloadTier(num_slots=1, disk_index=[], block_size=BS)
    tier.offload(5, (1, 0), (1, 2, 3, 4))
    assert (1, 0) in tier.host and not tier.on_disk((1, 0))
    step = tier.take_transfers()
    assert step is not None and [w[1:3] for w in step.writes] == [(1, 0)]
    tier.written(step)
    assert tier.on_disk((1, 0))


_HASHES = """
from aioengine.sampling_params import SamplingParams
from aioengine.sched.kv_cache_manager import KVCacheManager
from aioengine.sched.request import Request

kv = KVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
for salt in (None, "tenant-1"):
    r = Request("p", list(range(9)), SamplingParams(max_tokens=4), cache_salt=salt)
    kv.update_block_hashes(r)
    print(r.block_hashes)
"""


def test_block_hashes_are_the_same_in_every_process():
    """A disk tier's files outlive the server: a prompt's hashes, salted or not, are the same numbers in
    another process, whatever its string-hash seed (hash(None) and a str's hash are not)."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _HASHES],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(_HASHES, {})
    assert runs[0] == runs[1] == here.getvalue()
    plain, salted = (ast.literal_eval(line) for line in runs[0].splitlines())
    assert len(plain) == 2 and plain[0] != salted[0] and plain[1] != salted[1]
