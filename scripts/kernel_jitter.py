"""The decode GEMMs of a 30-layer SmolLM2-shaped model at 16 rows, timed per step, alone and beside a process
that burns 1.5 ms of CPU every 7.5 ms (what the event loop and an HTTP client add on a 2-core machine).
usage: python scripts/kernel_jitter.py [ROWS] [ROUNDS]"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from aioengine.kernels.cpu import clib

NOISE = (
    "import time\nwhile True:\n    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.0015: pass\n    time.sleep(0.006)"
)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    assert clib.load() is not None and clib.gemm_available(), "needs the C kernels' AVX512-BF16 GEMM"
    torch.manual_seed(0)
    shapes = (
        (960, 576, clib.GEMM_BF16),
        (576, 576, clib.GEMM_BF16),
        (3072, 576, clib.GEMM_ACT_MUL),
        (576, 1536, clib.GEMM_BF16),
    )
    layers = [
        [
            (
                clib.pack_gemm_weight(
                    torch.randn(n, k, dtype=torch.bfloat16) * 0.05, gated=e == clib.GEMM_ACT_MUL
                ),
                n,
                k,
                e,
            )
            for n, k, e in shapes
        ]
        for _ in range(30)
    ]
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (576, 1536)}

    def step() -> None:
        for layer in layers:
            for packed, n, k, e in layer:
                clib.gemm(xs[k], packed, None, n, e, "silu" if e == clib.GEMM_ACT_MUL else None)

    def run(steps: int = 150) -> str:
        for _ in range(10):
            step()
        ms = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t) * 1e3)
        ms.sort()
        p90, p99 = ms[int(0.9 * steps)], ms[int(0.99 * steps)]
        return f"p50 {statistics.median(ms):.2f}  p90 {p90:.2f}  p99 {p99:.2f} ms"

    for _ in range(rounds):
        print("alone:      ", run())
        noise = subprocess.Popen([sys.executable, "-c", NOISE])
        try:
            print("beside load:", run())
        finally:
            noise.kill()


if __name__ == "__main__":
    main()
