"""`aioengine bench step-noise`: the machine's own noise at a decode step's scale.

usage: aioengine bench step-noise [--seconds 20] [--threads 2]

Runs a fixed C workload back to back, the packed bf16 GEMMs of 30 SmolLM2-shaped layers at 16 rows (what
a 16-client decode step's linears do, weights streamed from DRAM, no Python between the calls), and prints
the passes' p99 / p50 and how many ran over 1.5x the median: the floor under any serving ITL tail here.
Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
LAYERS, ROWS = 30, 16


def run(seconds: float, threads: int) -> None:
    import torch

    from aioengine.kernels.cpu import clib

    lib = clib.load()
    if lib is None or not clib.gemm_available():
        raise SystemExit("the packed GEMM is not built here (needs AVX512-BF16 and a C compiler)")
    torch.set_num_threads(threads)
    weights = [
        [clib.pack_gemm_weight((torch.randn(n, k) * 0.02).bfloat16()) for n, k in SHAPES]
        for _ in range(LAYERS)
    ]
    xs = {k: torch.randn(ROWS, k).bfloat16() for _, k in SHAPES}
    ys = {n: torch.empty(ROWS, n, dtype=torch.bfloat16) for n, _ in SHAPES}
    calls = [
        (xs[k].data_ptr(), k, w.data_ptr(), None, ys[n].data_ptr(), n, ROWS, n, k, 0, None, threads)
        for layer in weights
        for (n, k), w in zip(SHAPES, layer, strict=True)
    ]
    gemm = lib.gemm_bf16
    assert all(gemm(*c) == 0 for c in calls)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for c in calls:
            gemm(*c)
        times.append(time.perf_counter() - t0)
    ordered = sorted(times)
    median, p99 = ordered[len(ordered) // 2], ordered[int(0.99 * len(ordered))]
    slow = [t > 1.5 * median for t in times]
    runs, current = [], 0
    for s in slow + [False]:
        if s:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    print(
        f"{len(times)} passes on {threads} threads: median {median * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms "
        f"(p99 / p50 {p99 / median:.2f}), max {ordered[-1] * 1e3:.1f} ms; {sum(slow)} over 1.5x the median "
        f"({100 * sum(slow) / len(times):.2f}%), the longest runs of them {sorted(runs, reverse=True)[:5]}"
    )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench step-noise", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long to run the passes")
    ap.add_argument("--threads", type=int, default=2, help="torch and GEMM threads")
    args = ap.parse_args(argv)
    run(args.seconds, args.threads)
