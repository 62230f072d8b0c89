"""`aioengine bench linear-layouts`: ms per call of a float32 linear at 1-512 rows, two weight layouts.

usage: aioengine bench linear-layouts

F.linear on [out, in] against a matmul on [in, out] held contiguous (gpu/cpu/linear.py's TransposedLinear),
for SmolLM2-135M's shapes, on 2 torch threads. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable


def per_call_ms(fn: Callable[[], object], n: int = 20) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench linear-layouts", description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    for out_features, in_features in [(1728, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(out_features, in_features)
        wt = w.t().contiguous()
        for rows in (1, 2, 4, 8, 16, 64, 512):
            x = torch.randn(rows, in_features)
            a = per_call_ms(functools.partial(torch.nn.functional.linear, x, w))
            b = per_call_ms(functools.partial(torch.Tensor.__matmul__, x, wt))  # x @ wt
            print(f"{out_features} x {in_features}, {rows} rows: F.linear {a:.3f} ms, transposed {b:.3f} ms")
