"""`aioengine bench allreduce`: one all-reduce's cost between tensor-parallel ranks on this node, per size.

Spawns the ranks as processes that all-reduce back to back, with nothing else to wait for: the figure is the
transport's own (gloo, and the CPU's shared-memory path), not the wait for a slower rank inside a step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any


def _rank(
    rank: int, size: int, init: str, transport: str, tokens: list[int], hidden: int, iters: int, q: Any
) -> None:
    import torch

    from aioengine.config import EngineArgs, KernelConfig
    from aioengine.executor.multiproc import SHM_ALLREDUCE_SLOT_BYTES
    from aioengine.gpu.backends import make_backend
    from aioengine.gpu.parallel import TPGroup

    torch.set_num_threads(1)
    shm = SHM_ALLREDUCE_SLOT_BYTES if transport == "shm" else 0
    # A CPU backend without its C kernels: only its process group and shared-memory all-reduce are used.
    backend = make_backend(EngineArgs(device="cpu", kernels=KernelConfig(cpu_kernels=False)))
    group = TPGroup(init, rank, size, backend, 60, "bench", False, shm)
    out = {}
    for n in tokens:
        x = torch.randn(n, hidden)
        for _ in range(max(10, iters // 10)):
            group.all_reduce(x)
        t0 = time.perf_counter()
        for _ in range(iters):
            group.all_reduce(x)
        out[n] = (time.perf_counter() - t0) / iters * 1e6
    group.barrier()
    if rank == 0:
        q.put(out)


def run_allreduce(args: argparse.Namespace) -> dict:
    from aioengine.gpu.parallel import free_port

    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"mode": "allreduce", "tensor_parallel_size": args.tensor_parallel_size}
    for transport in ("gloo", "shm"):
        q = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            ctx.Process(
                target=_rank,
                args=(
                    r,
                    args.tensor_parallel_size,
                    init,
                    transport,
                    args.num_tokens,
                    args.hidden_size,
                    args.iters,
                    q,
                ),
            )
            for r in range(args.tensor_parallel_size)
        ]
        for p in procs:
            p.start()
        us = q.get(timeout=300)
        for p in procs:
            p.join(60)
        result[transport] = {f"{n}x{args.hidden_size}_us": us[n] for n in args.num_tokens}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aioengine bench allreduce", description=__doc__)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--hidden-size", type=int, default=576, help="the default model's (576)")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    result = run_allreduce(args)
    for transport in ("gloo", "shm"):
        line = ", ".join(f"{k.removesuffix('_us')}: {v:.1f} us" for k, v in result[transport].items())
        print(f"all-reduce over {args.tensor_parallel_size} ranks, {transport}: {line}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
