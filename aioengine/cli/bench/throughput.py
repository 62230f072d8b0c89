"""`aioengine bench throughput`: offline, in-process; all requests at once, report tokens per second."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import functools
import io
import pstats
import tempfile
import time
from collections.abc import Iterable

from tqdm import tqdm

from aioengine.cli.bench.datasets import BenchRequest, add_dataset_args, build_dataset
from aioengine.cli.bench.lora import write_random_adapters
from aioengine.cli.bench.report import write_json
from aioengine.cli.bench.roofline import matmul_gflops, roofline_tokens_per_s
from aioengine.cli.common import add_engine_args, engine_args_from, run_in_loop
from aioengine.engine.async_engine import AsyncEngine
from aioengine.outputs import RequestOutput
from aioengine.sampling_params import SamplingParams


async def run_throughput(args: argparse.Namespace) -> dict:
    engine_args = engine_args_from(args)
    if args.random_loras:  # adapters of the model's shapes, every request under one of them in turn
        model, folder = engine_args.model, tempfile.mkdtemp()
        adapters = write_random_adapters(model, args.random_loras, args.lora_rank, folder)
        engine_args = dataclasses.replace(
            engine_args,
            enable_lora=True,
            lora_modules=adapters,
            max_loras=max(engine_args.max_loras, len(adapters)),
            max_lora_rank=max(engine_args.max_lora_rank, args.lora_rank),
        )
    engine = AsyncEngine(engine_args)
    t_start = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t_start
    try:
        requests = build_dataset(args, engine.tokenizer)
        bar = tqdm(total=len(requests), desc="requests", disable=args.no_progress)

        loras = engine.lora_names

        async def one(i: int, req: BenchRequest) -> RequestOutput:
            params = SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=args.ignore_eos)
            lora = loras[i % len(loras)] if loras else None  # spread evenly over the adapters
            out = await engine.generate(req.prompt_token_ids, params, lora=lora)
            out.metrics["finish_time"] = time.monotonic()
            bar.update(1)
            return out

        assert engine.runner is not None and engine.backend is not None  # set by start()
        runner = engine.runner
        timeline = engine.backend.timeline  # CUDA: events around each step
        if timeline is not None:
            await engine.run_on_worker(timeline.reset)
        await engine.run_on_worker(runner.host_s.clear)
        engine.host_s.clear()
        comm0 = engine.comm_stats()
        profile_path = getattr(args, "profile_host", None)
        num_params = runner.num_parameters()
        active = runner.num_active_parameters()  # a mixture's tokens run their chosen experts only
        bytes_per_token = runner.active_weight_bytes_per_token()
        dtype_name = str(runner.dtype).removeprefix("torch.")
        device = engine.backend.name
        # The roofline before the run and after it, the better kept: a busy spell on a shared machine that
        # halves one measurement would double the fraction of it. Both run on the worker, the process's
        # only OpenMP master: a pool of this thread's makes libgomp throttle the kernels' threads.
        roofline = functools.partial(matmul_gflops, dtype_name, engine.backend)
        gflops_runs = [await engine.run_on_worker(roofline)]
        profiler = await HostProfiler.start(engine) if profile_path else None
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - t0
        if profiler is not None:
            assert profile_path is not None  # the profiler runs only with a path
            await profiler.stop(profile_path)
        bar.close()
        gpu = (await engine.run_on_worker(timeline.stats)).as_dict() if timeline is not None else {}
        host = host_ms_per_step(engine.host_s, await engine.run_on_worker(runner.host_s.copy))
        spec = spec_stats(engine)
        tp = tp_stats(comm0, engine.comm_stats(), engine.host_s["steps"], engine.args.tensor_parallel_size)
        gflops_runs.append(await engine.run_on_worker(roofline))
    finally:
        await engine.shutdown()
    gflops = max(gflops_runs)
    in_tokens = sum(len(r.prompt_token_ids) for r in requests)
    out_tokens = sum(o.num_generated_tokens for o in outs)
    return {
        "mode": "throughput",
        "num_requests": len(requests),
        "num_loras": len(loras),
        "elapsed_s": elapsed,
        "engine_start_s": start_s,
        "requests_per_s": len(requests) / elapsed,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ignore_eos": args.ignore_eos,
        "input_tokens_per_s": in_tokens / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "dtype": dtype_name,
        "device": device,
        "num_parameters": num_params,
        "num_active_parameters": active,
        "active_weight_bytes_per_token": bytes_per_token,
        "matmul_gflops": gflops,
        "matmul_gflops_runs": gflops_runs,
        "roofline_tokens_per_s": roofline_tokens_per_s(gflops, active),
        "fraction_of_roofline": out_tokens / elapsed / roofline_tokens_per_s(gflops, active),
        **latency_stats(outs),
        **spec,
        **tp,
        **gpu,
        "host_ms_per_step": host,
    }


def tp_stats(before: dict, after: dict, steps: float, size: int) -> dict:
    """Tensor parallelism's cost per step on rank 0: writing each call for the other ranks, and the
    all-reduces (their wait for the slowest rank included)."""
    if not after or not steps:
        return {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    return {
        "tensor_parallel_size": size,
        "tp_broadcast_ms_per_step": 1e3 * d["broadcast_s"] / steps,
        "tp_broadcast_bytes_per_step": d["broadcast_bytes"] / steps,
        "tp_all_reduce_ms_per_step": 1e3 * d["all_reduce_s"] / steps,
        "tp_all_reduces_per_step": d["all_reduce_calls"] / steps,
    }


def spec_stats(engine: AsyncEngine) -> dict:
    """Speculative decoding's verdicts over the run (empty when it is off): the share of draft tokens
    accepted, and the mean tokens a verified step gives a request (accepted drafts plus one)."""
    if engine.scheduler is None or engine.args.speculative_config is None:
        return {}
    t = engine.scheduler.spec_totals
    return {
        "spec_num_drafts": t.num_drafts,
        "spec_num_draft_tokens": t.num_draft_tokens,
        "spec_num_accepted_tokens": t.num_accepted_tokens,
        "spec_acceptance_rate": t.num_accepted_tokens / t.num_draft_tokens if t.num_draft_tokens else 0.0,
        "spec_mean_accepted_length": 1 + t.num_accepted_tokens / t.num_drafts if t.num_drafts else 0.0,
        "spec_accepted_per_position": list(t.accepted_per_pos),
    }


class HostProfiler:
    """cProfile on the loop's thread and the device worker's while the bench runs (Python 3.12 profiles every
    thread with the first one), written as text: where the host's time per step goes. Slows the run down."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.loop_prof = cProfile.Profile()
        self.worker_prof: cProfile.Profile | None = cProfile.Profile()

    @classmethod
    async def start(cls, engine: AsyncEngine) -> HostProfiler:
        self = cls(engine)
        self.loop_prof.enable()
        assert self.worker_prof is not None  # made by __init__
        try:
            await engine.run_on_worker(self.worker_prof.enable)
        except (ValueError, RuntimeError):  # 3.12+: the loop's profiler already covers this thread
            self.worker_prof = None
        return self

    async def stop(self, path: str) -> None:
        self.loop_prof.disable()
        if self.worker_prof is not None:
            await self.engine.run_on_worker(self.worker_prof.disable)
        out = io.StringIO()
        for name, prof in (("loop thread", self.loop_prof), ("device worker thread", self.worker_prof)):
            if prof is None:
                continue
            for key in ("tottime", "cumulative"):
                out.write(f"==== {name}, by {key}\n")
                pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
        with open(path, "w") as f:
            f.write(out.getvalue())


def host_ms_per_step(loop_s: dict[str, float], worker_s: dict[str, float]) -> dict[str, float]:
    """Milliseconds per awaited step of each host phase: the loop's (schedule, update, outputs) and the
    device worker's (prepare, forward, sample). On CUDA the worker's are launch times, not device time."""
    steps = max(loop_s.get("steps", 0), 1)
    phases = {f"loop_{k}": v for k, v in loop_s.items() if k != "steps"}
    phases.update({f"worker_{k}": v for k, v in worker_s.items()})
    return {k: 1e3 * v / steps for k, v in sorted(phases.items())}


def latency_stats(outs: Iterable[RequestOutput]) -> dict:
    """Mean TTFT (arrival to first token) and TPOT (first to last token, per later token), in ms."""
    ttft, tpot = [], []
    for o in outs:
        m = o.metrics
        if m.get("first_token_time") is None:
            continue
        ttft.append(m["first_token_time"] - m["arrival_time"])
        n = o.num_generated_tokens
        if n > 1:
            tpot.append((m["finish_time"] - m["first_token_time"]) / (n - 1))
    return {
        "mean_ttft_ms": 1e3 * sum(ttft) / max(len(ttft), 1),
        "mean_tpot_ms": 1e3 * sum(tpot) / max(len(tpot), 1),
    }


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="aioengine bench throughput", description=__doc__.splitlines()[0])
    add_engine_args(ap)
    add_dataset_args(ap)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--profile-host",
        metavar="FILE",
        help="cProfile the loop and the device worker during the run; write the top functions to FILE",
    )
    ap.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every request runs to --output-len (the default); --no-ignore-eos ends each where the model "
        "ends it, as a user's request does (the grounded dataset's answer is the copy, not what follows it)",
    )
    ap.add_argument(
        "--random-loras",
        type=int,
        default=0,
        metavar="N",
        help="serve N random LoRA adapters of the model's shapes, the requests spread evenly over them",
    )
    ap.add_argument("--lora-rank", type=int, default=16, help="the random adapters' rank")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    result = run_in_loop(run_throughput(args))  # uvloop, as `aioengine serve` runs
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.1f} total "
        f"tokens/s, {result['output_tokens_per_s']:.1f} output tokens/s "
        f"({result['num_requests']} requests, {result['input_tokens']} input + "
        f"{result['output_tokens']} output tokens in {result['elapsed_s']:.2f} s; "
        f"engine start {result['engine_start_s']:.1f} s)"
    )
    print(
        f"Roofline ({result['dtype']} on {result['device']}): "
        f"matmul {result['matmul_gflops']:.0f} GFLOP/s / (2 x {result['num_active_parameters'] / 1e6:.1f}M "
        f"active params of {result['num_parameters'] / 1e6:.1f}M) = {result['roofline_tokens_per_s']:.0f} "
        f"tokens/s; output tokens/s is {100 * result['fraction_of_roofline']:.1f}% of it; "
        f"{result['active_weight_bytes_per_token'] / 1e6:.1f} MB of weights read per token "
        f"(matmul before and after the run: {', '.join(f'{g:.0f}' for g in result['matmul_gflops_runs'])})"
    )
    host = result["host_ms_per_step"]
    if host:
        print("Host ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    kinds = sorted(k.removeprefix("gpu_steps_") for k in result if k.startswith("gpu_steps_"))
    if kinds:
        print(
            "GPU idle by step kind: "
            + ", ".join(
                f"{k} {100 * result['gpu_idle_fraction_' + k]:.1f}% of {result['gpu_steps_' + k]} steps"
                for k in kinds
            )
        )
    print(
        f"Latency: mean TTFT {result['mean_ttft_ms']:.1f} ms, mean TPOT {result['mean_tpot_ms']:.2f} ms"
        + (
            f"; GPU idle between steps {100 * result['gpu_idle_fraction']:.1f}% "
            f"of {result['gpu_steps']} steps"
            if "gpu_idle_fraction" in result
            else ""
        )
    )
    if "spec_num_drafts" in result:
        print(
            f"Speculative decoding: {result['spec_num_drafts']} drafts, acceptance rate "
            f"{100 * result['spec_acceptance_rate']:.1f}% of {result['spec_num_draft_tokens']} draft tokens, "
            f"mean accepted length {result['spec_mean_accepted_length']:.2f}, "
            f"accepted per position {result['spec_accepted_per_position']}"
        )
    write_json(args.output_json, result)
    return result
