"""The machine's matmul roofline: measured GFLOP/s of a large torch matmul, and what it allows in tokens/s."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend


def matmul_gflops(
    dtype_name: str,
    backend: Backend,
    num_threads: int | None = None,
    n: int | None = None,
    iters: int = 5,
    repeats: int = 5,
) -> float:
    """The best of ``repeats`` timings of ``iters`` n x n matmuls on the backend's device: a roofline is the
    machine's peak, and one timing on a shared machine can come out far low, which would inflate every
    fraction of it. ``n``: the backend's size that fills the device."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    n = n or backend.roofline_matmul_n
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype, device=backend.device)
    b = torch.randn(n, n, dtype=dtype, device=backend.device)
    sync = backend.synchronize
    for _ in range(2):
        a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 * iters / best / 1e9


def roofline_tokens_per_s(gflops: float, num_params: int) -> float:
    """Decode needs about 2 FLOPs per parameter per token."""
    return gflops * 1e9 / (2 * num_params)
