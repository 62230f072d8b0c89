"""Micro-benchmark: microseconds per request per step for schedule() + update_from_output() while decoding.

usage: aioengine bench scheduler [--num-reqs 256 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import ModelRunnerOutput, SchedulerOutput
from aioengine.sched.request import Request
from aioengine.sched.scheduler import Scheduler, SchedulerConfig


def bench(num_reqs: int, steps: int, prompt_len: int = 128) -> float:
    """Median µs per request per step, with the batch queue of 2 the engine uses."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(8192, num_reqs * prompt_len),
            max_num_seqs=num_reqs,
            max_model_len=4096,
            num_blocks=num_reqs * 32 + 1,
            block_size=16,
        )
    )
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    for i in range(num_reqs):
        sched.add_request(Request(f"req-{i}", [i % 50_000 + 1] * prompt_len, params))

    def fake_output(out: SchedulerOutput) -> ModelRunnerOutput:
        ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(ids, [[7] for _ in ids])

    pending = sched.schedule()  # the prefill step
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(pending, fake_output(pending))
        times.append(time.perf_counter() - t0)
        pending = out
    return statistics.median(times) / num_reqs * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="aioengine bench scheduler", description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    for n in args.num_reqs:
        print(
            f"running decode requests={n}: {bench(n, args.steps):.2f} µs per request per step "
            f"(schedule + update_from_output, median of {args.steps} steps)"
        )


if __name__ == "__main__":
    main()
