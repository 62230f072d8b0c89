"""The machine's matmul roofline: measured GFLOP/s of a large torch matmul, and what it allows in tokens/s."""

from __future__ import annotations

import time


def matmul_gflops(
    dtype_name: str,
    num_threads: int | None = None,
    n: int | None = None,
    iters: int = 5,
    repeats: int = 5,
    device: str = "cpu",
) -> float:
    """The best of ``repeats`` timings of ``iters`` n x n matmuls on ``device``: a roofline is the machine's
    peak, and one timing on a shared machine can come out far low, which would inflate every fraction of
    it. ``n``: 2048 on CPU, 8192 on a GPU (big enough to fill it)."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    cuda = device == "cuda"
    n = n or (8192 if cuda else 2048)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
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
