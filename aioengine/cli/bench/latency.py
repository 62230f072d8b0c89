"""`aioengine bench latency`: a batch of requests decoding together; time per decode step and per request."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from aioengine.cli.bench.report import write_json
from aioengine.cli.common import add_engine_args, engine_args_from, run_in_loop
from aioengine.engine.async_engine import AsyncEngine
from aioengine.sampling_params import SamplingParams


async def run_latency(args: argparse.Namespace) -> dict:
    engine = AsyncEngine(engine_args_from(args))
    await engine.start()
    try:
        prompt = list(range(1000, 1000 + args.input_len))
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        e2e, step_times = [], []
        runner = engine.runner
        assert runner is not None  # started
        host: dict[str, float] = {}
        steps = 0
        for it in range(args.num_iters_warmup + args.num_iters):
            if it == args.num_iters_warmup:  # the worker's own counters, from the first measured iteration
                host, steps = dict(runner.host_s), runner.num_steps
            stamps: list[float] = []

            async def one(i: int, stamps: list[float] = stamps) -> None:
                async for _ in engine.generate([i + 1] + prompt, params):
                    if i == 0:
                        stamps.append(time.perf_counter())

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(args.batch_size)))
            if it >= args.num_iters_warmup:
                e2e.append(time.perf_counter() - t0)
                # Gaps between the tokens of one request, first token (prefill) excluded.
                step_times += [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]
        steps = runner.num_steps - steps
        split = {k: (v - host.get(k, 0.0)) / steps * 1e3 for k, v in runner.host_s.items()} if steps else {}
    finally:
        await engine.shutdown()
    step = statistics.median(step_times)
    return {
        # Mean ms per step (prefills included) on the worker: inputs, the forward (on the CPU the kernels:
        # the one-call stack, or the Python path's ops), sampling (the LM head's GEMM and the sampler).
        "worker_ms_per_step": split,
        "mode": "latency",
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "e2e_s_median": statistics.median(e2e),
        "decode_step_ms_median": step * 1e3,
        "decode_step_ms_p99": sorted(step_times)[int(0.99 * (len(step_times) - 1))] * 1e3,
        "decode_tokens_per_s": args.batch_size / step,
    }


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="aioengine bench latency", description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    if args.output_len < 3:  # the first gap includes the prefill: two decode gaps need three tokens
        ap.error("--output-len must be at least 3 to time a decode step")
    if args.num_iters < 1:
        ap.error("--num-iters must be at least 1")
    r = run_in_loop(run_latency(args))  # uvloop, as `aioengine serve` runs
    print(
        f"Latency: batch {r['batch_size']}, decode step {r['decode_step_ms_median']:.2f} ms median "
        f"({r['decode_step_ms_p99']:.2f} ms p99) = {r['decode_tokens_per_s']:.1f} tokens/s; "
        f"request end-to-end {r['e2e_s_median']:.2f} s for {r['output_len']} tokens"
    )
    if r["worker_ms_per_step"]:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["worker_ms_per_step"].items())
        print(f"Worker per step (mean, ms): {parts}; the rest of a step is the loop's (scheduler, outputs)")
    write_json(args.output_json, r)
    return r
