"""The CPU's shared-memory all-reduce: sums equal the torch sum, every rank gets the same bits, the slots
alternate safely over many calls of changing shapes, and a wait gives up on abort or timeout."""

from __future__ import annotations

import threading

import pytest
import torch

from aioengine.gpu.cpu.shm_allreduce import AllReduceAborted, ShmAllReduce


class DictStore(dict):
    """The two calls of a TCPStore the all-reduce makes."""

    def set(self, key: str, value: str) -> None:
        self[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self[key]


def _group(size: int, slot_bytes: int = 1 << 16, timeout_s: float = 30) -> list[ShmAllReduce]:
    store = DictStore()
    ranks = [ShmAllReduce(store, 0, size, slot_bytes, timeout_s)]
    ranks += [ShmAllReduce(store, r, size, slot_bytes, timeout_s) for r in range(1, size)]
    ranks[0].unlink()
    return ranks


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order_over_many_calls(size):
    ranks = _group(size)
    shapes = [(1, 8), (5, 8), (64, 16), (1, 8)] * 25  # the slots alternate 100 times, shapes change
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(size)]
    outputs: list[list[torch.Tensor]] = [[] for _ in range(size)]

    def run(r: int) -> None:
        for x in inputs[r]:
            outputs[r].append(ranks[r].all_reduce(x.clone()))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(len(shapes)):
        expected = inputs[0][i].clone()
        for r in range(1, size):
            expected += inputs[r][i]
        for r in range(size):
            assert torch.equal(outputs[r][i], expected)  # the same bits as adding in rank order


def test_a_wait_for_a_rank_that_never_comes_gives_up():
    r0, _ = _group(2, timeout_s=0.3)
    with pytest.raises(AllReduceAborted, match="within 0.3 s"):
        r0.all_reduce(torch.ones(4))
    r0, _ = _group(2)
    threading.Timer(0.2, r0.abort).start()
    with pytest.raises(AllReduceAborted, match="aborted"):
        r0.all_reduce(torch.ones(4))


def test_only_contiguous_tensors_that_fit_a_slot_take_it():
    (r0,) = _group(1, slot_bytes=64)
    assert r0.fits(torch.ones(16)) and not r0.fits(torch.ones(17)) and not r0.fits(torch.ones(4, 4).t())
