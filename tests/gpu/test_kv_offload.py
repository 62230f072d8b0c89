"""The host tier's copies on CPU tensors in the CPU backend's layout: a store then a load gives back the
block; a slot stored twice in one step keeps the second block and hands the first to the disk writer
as it was; a slot's bytes fill another tier's slot exactly."""

from __future__ import annotations

import torch

from aioengine.gpu.kv_offload import HostKVTier
from aioengine.sched.kv_offload import KVTransfers


def _caches(n: int = 3, blocks: int = 6, seed: int = 0) -> list[torch.Tensor]:
    # [2, blocks, heads, size, dim] memory behind the [2, blocks, size, heads, dim] shape, as on CPU
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((2, blocks, 2, 4, 8), generator=g).transpose(2, 3) for _ in range(n)]


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def test_store_then_load_moves_a_block():
    caches = _caches()
    tier = HostKVTier(caches, 4, _empty)
    want = [c[:, 2].clone() for c in caches]
    tier.run(KVTransfers(stores=[(2, 3)]))
    for c in caches:
        c[:, 2] = 0
    tier.run(KVTransfers(loads=[(3, 5)]))
    for c, w in zip(caches, want, strict=True):
        assert torch.equal(c[:, 5], w)


def test_a_slot_stored_twice_in_one_step_and_the_disk_writes():
    caches = _caches()
    tier = HostKVTier(caches, 2, _empty)
    written: dict[int, bytes] = {}
    tier.disk_write = lambda h, g, toks, data: written.__setitem__(h, data)
    steps = KVTransfers(stores=[(1, 0), (4, 0)], writes=[(0, 11, 0, (1,)), (1, 44, 0, (2,))])
    tier.run(steps)
    assert written[11] == tier.block_bytes_of(1) and written[44] == tier.block_bytes_of(4)
    assert tier.slot_bytes(0) == tier.block_bytes_of(4)
    tier.run(KVTransfers(pool_writes=[(5, 55, 0, (3,))]))
    assert written[55] == tier.block_bytes_of(5)

    other = HostKVTier(_caches(seed=1), 2, _empty)
    other.fill(1, written[11])
    other.run(KVTransfers(loads=[(1, 0)]))
    for c, mine in zip(other.caches, caches, strict=True):
        assert torch.equal(c[:, 0], mine[:, 1])
