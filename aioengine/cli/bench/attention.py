"""`aioengine bench attention`: the CPU decode-attention kernel alone, 30 layers of SmolLM2's shapes.

usage:
    aioengine bench attention bench [--values-from-keys] [--hot N]
    aioengine bench attention synthetic --context 224 --shared 0.5 [--values-from-keys]

Its time on DRAM and on arithmetic. ``bench`` takes the block tables and lengths of seven decode steps
spread over a run of the offline bench's workload (64 prompts, 128 tokens each, captured from the engine),
layer l on step l mod 7's; ``synthetic`` gives 64 requests of one length, each block shared by all of them
with probability ``--shared``. Every layer has its own 2 GiB / 30 cache, blocks placed at random.
``--values-from-keys`` reads V from K's lines (half the DRAM lines, the same instructions); ``--hot N`` maps
block ids mod N (N = 32: every read hits L2, the arithmetic alone). Prints the median ms per step.
Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from aioengine.gpu.cpu.decode_stack import CpuDecodeStack
    from aioengine.kernels.metadata import AttentionMetadata

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CACHE_BYTES = 2 << 30


async def captured_steps(every: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(block table, seq lens) of the offline bench's decode-only steps of 64 rows, one step in ``every``."""
    from aioengine.cli.bench.datasets import shared_workload
    from aioengine.config import EngineArgs
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.sampling_params import SamplingParams

    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    async with AsyncEngine(EngineArgs(model="default")) as engine:
        stack: CpuDecodeStack | None = getattr(engine.backend, "decode_stack", None)  # the CPU backend's
        if stack is None:
            raise SystemExit("the decode stack is not built here (needs the C kernels with AVX512-BF16)")
        run = stack.run

        def capture(
            hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if meta.num_decodes == meta.num_reqs == 64:
                steps.append((meta.block_table.clone(), meta.seq_lens.clone()))
            return run(hidden, positions, meta, *args, **kwargs)

        stack.run = capture  # type: ignore[method-assign]  # an instance's patch: records each step's tables
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        requests = shared_workload(engine.tokenizer, 64, 128)
        await asyncio.gather(*(engine.generate(r.prompt_token_ids, params) for r in requests))
    return steps[::every]


def synthetic_steps(context: int, shared: float, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import torch

    rng = random.Random(0)
    order = rng.sample(range(num_blocks), num_blocks)
    per_req = -(-context // BLOCK)
    common, fresh = order[:per_req], iter(order[per_req:])
    table = torch.tensor(
        [[common[j] if rng.random() < shared else next(fresh) for j in range(per_req)] for _ in range(64)],
        dtype=torch.int32,
    )
    return [(table, torch.full((64,), context, dtype=torch.int32))]


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("tables", choices=("bench", "synthetic"))
    ap.add_argument("--context", type=int, default=224)
    ap.add_argument("--shared", type=float, default=0.0)
    ap.add_argument("--values-from-keys", action="store_true")
    ap.add_argument("--hot", type=int, default=0)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    from aioengine.kernels.cpu import clib

    lib = clib.load()
    if lib is None or not lib.decode_attention_bf16_vectorized():
        raise SystemExit("the AVX512-BF16 decode-attention kernel is not built here")
    num_blocks = CACHE_BYTES // (LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 2)
    if args.tables == "bench":
        steps = asyncio.run(captured_steps())
    else:
        steps = synthetic_steps(args.context, args.shared, num_blocks)
    if args.hot:
        steps = [(table % args.hot, lens) for table, lens in steps]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    # the CPU backend's head-major memory behind the usual [2, blocks, block_size, heads, head_dim] view
    caches = [
        torch.randn((2, num_blocks, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16).transpose(2, 3)
        for _ in range(LAYERS)
    ]
    query = torch.randn((64, HEADS, HEAD_DIM), dtype=torch.bfloat16)
    out = torch.empty_like(query)

    def step() -> None:
        for layer, cache in enumerate(caches):
            table, lens = steps[layer % len(steps)]
            keys, values = clib.cache_pointers(cache)
            status = lib.decode_attention_bf16(
                query.data_ptr(), query.stride(0), keys, keys if args.values_from_keys else values,
                table.data_ptr(), table.stride(0), lens.data_ptr(), out.data_ptr(), 64, HEADS, KV_HEADS,
                HEAD_DIM, BLOCK, HEAD_DIM**-0.5, 0, cache.stride(1), cache.stride(2), cache.stride(3), 2,
            )  # fmt: skip
            assert status == 0

    for _ in range(3):
        step()
    times: list[float] = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    label = "bench" if args.tables == "bench" else f"synthetic {args.context} tokens, {args.shared} shared"
    label += (" values from keys" if args.values_from_keys else "") + (f" hot {args.hot}" if args.hot else "")
    median, least = times[len(times) // 2], times[0]
    print(f"{label}: median {median * 1e3:.2f} ms, min {least * 1e3:.2f} ms per step")
