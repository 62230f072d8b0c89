"""`aioengine bench serve`: stream completions from any OpenAI-compatible server; TTFT, TPOT, ITL, E2E.

Requests arrive as a Poisson process (`--request-rate`, default all at once) under an optional
`--max-concurrency`; every request streams, and each server-sent chunk with text is a token arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from aioengine.cli.bench.datasets import BenchRequest, add_dataset_args, build_dataset
from aioengine.cli.bench.proc_cpu import CpuSnapshot, ProcCpuError, cpu_split
from aioengine.cli.bench.report import write_json
from aioengine.cli.common import run_in_loop


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0


async def _one(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict) -> RequestResult:
    r = RequestResult(start=time.perf_counter())
    last = r.start
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            buf = b""
            async for raw in resp.content:
                buf += raw
                if not buf.endswith(b"\n"):
                    continue
                line, buf = buf.strip(), b""
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = orjson.loads(data)
                if msg.get("usage"):
                    r.output_tokens = msg["usage"].get("completion_tokens", r.output_tokens)
                    r.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                choices = msg.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                text = c.get("text")
                if text is None:
                    text = (c.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if not r.chunk_times:
                        r.ttft = now - r.start
                    else:
                        r.itl.append(now - last)
                    r.chunk_times.append(now - r.start)
                    last = now
        r.e2e = time.perf_counter() - r.start
        if not r.output_tokens:
            r.output_tokens = len(r.chunk_times)
        r.ok = bool(r.chunk_times)
        if not r.ok:
            r.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        r.error = repr(e)
    return r


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


async def run_serve(args: argparse.Namespace) -> dict:
    from aioengine.model.files import resolve_model
    from aioengine.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(resolve_model(args.tokenizer)))
    requests = build_dataset(args, tokenizer)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # A connection per request: a server that closes a keep-alive connection after a few requests (llama.cpp's
    # llama-server does) made a reused one fail on write, and those requests were lost from its figures.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.served_model
        if model is None:
            async with session.get(args.base_url + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
        rng = random.Random(args.seed)

        async def limited(req: BenchRequest) -> RequestResult:
            payload = {
                "model": model,
                "prompt": tokenizer.decode(req.prompt_token_ids),
                "max_tokens": req.output_len,
                "temperature": args.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if (
                args.ignore_eos
            ):  # an extension (vLLM's): strict servers refuse unknown fields, so only when asked
                payload["ignore_eos"] = True
            async with sem:
                return await _one(session, args.base_url + "/v1/completions", payload, headers)

        tasks = []
        cpu0 = CpuSnapshot.take(args.server_pid) if args.server_pid else None
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        cpu = cpu_split(args.server_pid, cpu0, CpuSnapshot.take(args.server_pid), duration) if cpu0 else None
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "base_url": args.base_url,
        "model": model,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "requests_per_s": len(ok) / duration,
        "ttft_s": _stats([r.ttft for r in ok]),
        "tpot_s": _stats(tpot),
        "itl_s": _stats([x for r in ok for x in r.itl]),
        "e2el_s": _stats([r.e2e for r in ok]),
    }
    if cpu is not None:
        summary["server_cpu"] = cpu
    if getattr(args, "save_detailed", False):  # vLLM's --save-detailed: every request's own timings
        summary["requests"] = [
            {
                "start_s": r.start - t0,
                "ttft_s": r.ttft,
                "itl_s": r.itl,
                "e2el_s": r.e2e,
                "output_tokens": r.output_tokens,
                "error": r.error,
            }
            for r in results
        ]
    summary["_results"] = (ok, t0)  # for --plot, dropped before saving
    return summary


def _plot(path: str, summary: dict, ok: list[RequestResult], t0: float) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'aioengine[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    names = ["ttft_s", "tpot_s", "itl_s", "e2el_s"]
    for i, q in enumerate(["p50", "p90", "p99"]):
        ax1.bar(
            [j + i * 0.27 for j in range(len(names))], [summary[n][q] * 1e3 for n in names], 0.27, label=q
        )
    ax1.set_xticks([j + 0.27 for j in range(len(names))], [n.removesuffix("_s").upper() for n in names])
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.legend()
    ax1.set_title("latency percentiles")
    arrivals = sorted(r.start - t0 + c for r in ok for c in r.chunk_times)
    if arrivals:
        width = max(arrivals[-1] / 50, 0.1)
        bins = [0] * (int(arrivals[-1] / width) + 1)
        for a in arrivals:
            bins[int(a / width)] += 1
        ax2.plot([i * width for i in range(len(bins))], [b / width for b in bins])
    ax2.set_xlabel("s")
    ax2.set_ylabel("streamed tokens/s")
    ax2.set_title("throughput over time")
    itl = sorted(x * 1e3 for r in ok for x in r.itl)
    if itl:  # the ITL distribution: where its tail starts
        ax3.plot(itl, [1 - (i + 0.5) / len(itl) for i in range(len(itl))])
    ax3.set_xlabel("ITL, ms")
    ax3.set_ylabel("fraction of gaps longer")
    ax3.set_yscale("log")
    ax3.set_title("inter-token latency")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="aioengine bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--served-model", help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--tokenizer", default="default", help="model dir whose tokenizer builds the prompts")
    ap.add_argument("--api-key")
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-result", help="write the summary as JSON here")
    ap.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: each request's start, TTFT, inter-token gaps and end-to-end latency",
    )
    ap.add_argument("--plot", help="write a PNG of latency percentiles and tokens/s over time")
    ap.add_argument(
        "--server-pid",
        type=int,
        help="a server on this machine (Linux): report its event loop's and other threads' CPU over the run",
    )
    add_dataset_args(ap)
    args = ap.parse_args(argv)
    if args.server_pid is not None:
        try:  # before the dataset and the run: a wrong pid is a usage error
            CpuSnapshot.take(args.server_pid)
        except ProcCpuError as e:
            ap.error(f"--server-pid: {e}")
    s = run_in_loop(run_serve(args))  # uvloop: the client's own overhead shares the server's CPUs
    ms = {k: {q: v * 1e3 for q, v in s[k].items()} for k in ("ttft_s", "tpot_s", "itl_s", "e2el_s")}
    print(
        f"Serving: {s['completed']}/{s['num_requests']} completed in {s['duration_s']:.2f} s, "
        f"{s['output_tokens_per_s']:.1f} output tokens/s, {s['requests_per_s']:.2f} requests/s"
    )
    for k, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2el_s", "E2E")):
        m = ms[k]
        print(
            f"  {name:5s} ms: mean {m['mean']:.1f}  p50 {m['p50']:.1f}  "
            f"p90 {m['p90']:.1f}  p99 {m['p99']:.1f}"
        )
    if s["failed"]:
        print(f"  failed: {s['failed']} ({s['errors']})")
    if "server_cpu" in s:
        c, tokens = s["server_cpu"], max(s["output_tokens"], 1)
        others = ", ".join(f"{x:.2f}" for x in c["other_threads_s"][:6])
        loop_ms = 1e3 * c["loop_s"] / tokens
        print(
            f"  server CPU (pid {c['pid']}): loop {c['loop_s']:.2f} s ({loop_ms:.3f} ms an output token), "
            f"other threads {c['server_s'] - c['loop_s']:.2f} s ({others}); client {c['client_s']:.2f} s; "
            f"{c['machine_s']:.1f} CPU-s in the run"
        )
    ok, t0 = s.pop("_results")
    write_json(args.save_result, s)
    if args.plot:
        _plot(args.plot, s, ok, t0)
    return s
