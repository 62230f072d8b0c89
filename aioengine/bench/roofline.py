"""The machine's matmul roofline: measured GFLOP/s of a large torch matmul, and what it allows in tokens/s."""

from __future__ import annotations

import time


def matmul_gflops(dtype_name: str, num_threads: int | None = None, n: int = 2048, iters: int = 10) -> float:
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (time.perf_counter() - t) / 1e9


def roofline_tokens_per_s(gflops: float, num_params: int) -> float:
    """Decode needs about 2 FLOPs per parameter per token."""
    return gflops * 1e9 / (2 * num_params)
