"""Staging: on CUDA (HostStaging) a step's inputs reach the device through pinned memory without the launching
thread waiting for the GPU (CUDA tests skip without one); on CPU (CpuStaging) they are the arrays
themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioengine.gpu.cpu.backend import CpuStaging
from aioengine.gpu.cuda.staging import HostStaging

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
ARRAYS = [
    np.arange(7, dtype=np.int64),
    np.arange(12, dtype=np.int32).reshape(3, 4),
    np.linspace(0, 1, 5, dtype=np.float32),
    np.array([True, False, True]),
    np.zeros((0, 3), np.int64),
    np.arange(20, dtype=np.int64)[::2],
]  # not contiguous


def test_on_cpu_the_tensor_shares_the_arrays_memory():
    staging = CpuStaging()
    staging.begin_step()
    a = np.arange(6, dtype=np.int64).reshape(2, 3)
    t = staging.to_device(a)
    assert t.dtype == torch.int64 and t.shape == (2, 3) and t.data_ptr() == a.ctypes.data
    for arr in ARRAYS:
        assert np.array_equal(staging.to_device(arr).numpy(), arr)


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("nbytes", [1 << 20, 64])  # 64: every array outgrows the buffer
def test_values_shapes_and_dtypes_arrive(nbytes):
    staging = HostStaging(torch.device("cuda"), nbytes=nbytes)
    for _ in range(3):
        staging.begin_step()
        got = [staging.to_device(a) for a in ARRAYS]
        torch.cuda.synchronize()
        for a, t in zip(ARRAYS, got, strict=True):
            assert t.is_cuda and t.shape == a.shape and np.array_equal(t.cpu().numpy(), a)


@pytest.mark.gpu
@cuda_only
def test_copies_do_not_wait_for_the_gpu_and_a_buffer_waits_for_its_copies():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        staging = HostStaging(torch.device("cuda"), nbytes=1 << 16)
        big = np.arange(4096, dtype=np.int64)
        staging.begin_step()  # slot 1
        torch.cuda._sleep(300_000_000)  # ~0.15-0.3 s of GPU spinning ahead of the copies
        spun = torch.cuda.Event()
        spun.record()  # complete once the GPU is past the spin: the unit both orderings below are read in
        first = staging.to_device(big)
        second = staging.to_device(big * 2)
        assert not spun.query(), "to_device waited for the GPU"  # the copies are queued, the GPU still spins
        staging.begin_step()  # slot 0: never used, no wait
        other = staging.to_device(big * 3)
        assert not spun.query(), "the GPU finished spinning before the test could see a wait: spin longer"
        staging.begin_step()  # slot 1 again: its copies are still behind the spin, so this must wait
        assert spun.query(), "begin_step reopened a buffer whose copies had not run"
        staging.to_device(np.zeros(4096, dtype=np.int64))  # overwrites slot 1's pinned bytes
        torch.cuda.synchronize()
    assert np.array_equal(first.cpu().numpy(), big) and np.array_equal(second.cpu().numpy(), big * 2)
    assert np.array_equal(other.cpu().numpy(), big * 3)


@pytest.mark.gpu
@cuda_only
def test_cuda_greedy_takes_the_bf16_argmax_without_widening():
    from aioengine.gpu.cuda.backend import CudaOps

    logits = torch.randn(64, 50_000, device="cuda").to(torch.bfloat16)
    logits[3, 17] = logits[3, 40_000] = 100.0  # a tie: the first index wins, as on the widened copy
    assert torch.equal(CudaOps().argmax(logits), logits.float().argmax(-1))
