"""cpu_pool.c, how the C kernels split a call between threads: every unit runs once, a thread takes over
what another has not started, and kernels whose units then come out of order still give torch's answer."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from aioengine.kernels.cpu import clib, q8

lib = clib.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the CPU kernels")


def _count(units: int, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts, slots, stolen = (np.zeros(units, dtype=np.int32) for _ in range(3))
    lib.pool_count(units, threads, counts.ctypes.data, slots.ctypes.data, stolen.ctypes.data)
    return counts, slots, stolen


@pytest.fixture
def held_worker():
    """OpenMP thread 1 claims nothing while the test runs: a thread the OS has preempted."""
    lib.pool_hold(1)
    yield
    lib.pool_hold(-1)


@pytest.mark.parametrize("units", [1, 2, 7, 1000, (1 << 21) + 5, (1 << 22) + 3])
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_every_unit_runs_once_on_a_thread_of_the_call(units: int, threads: int) -> None:
    counts, slots, _ = _count(units, threads)
    assert (counts == 1).all()
    assert slots.min() >= 0 and slots.max() < threads


def test_a_thread_takes_the_range_another_has_not_started(held_worker) -> None:
    # a static split would leave thread 1's half to thread 1; here thread 0 takes it, from the back
    for _ in range(3):
        counts, slots, stolen = _count(64, 2)
        assert (counts == 1).all() and (slots == 0).all()
        assert not stolen[:32].any() and stolen[32:].all()


def test_calls_from_two_threads_at_once_each_run_every_unit() -> None:
    results: list[np.ndarray] = []

    def call() -> None:
        for _ in range(50):
            counts, _, _ = _count(5000, 2)
            results.append(counts)

    workers = [threading.Thread(target=call) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(results) == 100 and all((c == 1).all() for c in results)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(lib is None or not clib.gemm_available(), reason="cpu_gemm.c needs AVX512-BF16")
def test_gemm_argmax_keeps_the_first_tie_when_panels_come_out_of_order(two_threads, held_worker) -> None:
    # 4 panels of 64 columns, one row: thread 1's range is panels 2 and 3, which thread 0 takes back to
    # front. Columns 130 and 194 share a lane and tie: the answer is 130, as torch.argmax gives.
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(256, 64, dtype=torch.bfloat16)
    w[130] = w[194] = 1.0
    got = clib.gemm(x, clib.pack_gemm_weight(w), None, 256, clib.GEMM_ARGMAX)
    assert got.tolist() == [130] == torch.argmax((x.float() @ w.float().T), dim=-1).tolist()


@pytest.mark.skipif(lib is None or not q8.available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
def test_q8_argmax_keeps_the_first_tie_and_nan_when_outputs_come_out_of_order(
    two_threads, held_worker
) -> None:
    # thread 1's range is outputs 3000-5999, which thread 0 takes back to front
    n, k = 6000, 64
    q = torch.zeros(n, k, dtype=torch.int8)
    q[:, 0] = 1
    scale = torch.full((n, 2), 0.5)
    x = torch.zeros(1, k)
    x[:, 0] = 1.0
    scale[[4000, 5000], 0] = 2.0
    assert q8.qgemv_f32(x, q8.pack(q), scale, argmax=True).tolist() == [4000]
    scale[[4500, 5500], 1] = float("nan")
    assert q8.qgemv_f32(x, q8.pack(q), scale, argmax=True).tolist() == [4500]
