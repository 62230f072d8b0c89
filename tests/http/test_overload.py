"""Overload: 1,000 concurrent requests against --max-num-queued-reqs 128. The admitted ones complete in full,
the others get a quick 503 + Retry-After, the engine's queue never passes the limit, memory stays bounded,
and the server serves normally afterwards.

The load generator opens its 1,000 connections first, then writes every request at once (pre-encoded bytes,
so its own CPU time barely delays the responses it times), while torch computes on the same two cores: the
last refusal waits for the loop to answer the ones before it. "Quick" is measured against the cheapest answer
the server has, in the same burst: a `GET /health` after every 20 completions. A 503 that waited for the
engine (a step, the queue) would come later than the health checks sent beside it. docs/reliability.md has
the measured figures.
"""

from __future__ import annotations

import asyncio
import gc
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from tests.http.conftest import OVERLOAD_QUEUE_LIMIT, Http

pytestmark = pytest.mark.serial  # it measures timing or load: it runs alone

N_REQUESTS = 1000
MAX_TOKENS = 4
HEALTH_EVERY = 20  # a /health probe after every 20 completions of the burst
# Issue 7: every 503 as quick as a /health in the same burst (each statistic within 1.5 times; measured 1.0).
REFUSAL_PER_HEALTH = 1.5
RSS_GROWTH_MB = 300
ROOT = Path(__file__).resolve().parents[2]


def rss_mb() -> float:
    """This process's resident memory: the server runs in it."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
        )


def successes(metrics_text: str) -> float:
    return sum(
        float(m) for m in re.findall(r"^aioengine:request_success_total\{[^}]*\} (\S+)$", metrics_text, re.M)
    )


def overload(server, out: Path) -> tuple[list, dict]:
    """Fire N_REQUESTS at once at the "overload" app from a separate process (tests/http/loadgen.py)."""
    raise_fd_limit(N_REQUESTS + 512)  # the server's end of every connection lives in this process
    stats: dict = {"max_waiting": 0}
    stop = asyncio.Event()

    async def watch_queue() -> None:  # on the server's loop: the engine queue at every 2 ms
        while not stop.is_set():
            stats["max_waiting"] = max(stats["max_waiting"], len(server.engine.scheduler.waiting))
            await asyncio.sleep(0.002)

    rss_before = rss_mb()
    watcher = asyncio.run_coroutine_threadsafe(watch_queue(), server.loop)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.http.loadgen",
                server.url("overload"),
                str(N_REQUESTS),
                str(MAX_TOKENS),
                str(out),
                str(HEALTH_EVERY),
            ],
            cwd=ROOT,
            capture_output=True,
            timeout=300,
        )
    finally:
        server.loop.call_soon_threadsafe(stop.set)
        watcher.result(10)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    stats.update(elapsed=time.perf_counter() - t0, rss_growth=rss_mb() - rss_before)
    return orjson.loads(out.read_bytes()), stats


def test_1000_concurrent_requests_against_a_queue_of_128(server, tmp_path):
    assert gc.get_freeze_count() > 0  # the server's start-up freeze holds, though other apps came and went
    http = Http(server.url("overload"))
    assert http.post("/v1/completions", json={"prompt": "Warm up", "max_tokens": 2}).status == 200
    server.wait_idle()
    before_ok = successes(http.get("/metrics").body.decode())
    # A server's heap is its model and libraries, frozen out of the GC at start-up; this process also holds
    # the test session's (pytest, hypothesis, other tests): freeze those too, or a full collection over them
    # (~0.3 s in the whole suite) lands in the burst.
    gc.collect()
    gc.freeze()
    answers, stats = overload(server, tmp_path / "burst.json")
    results = [r for r in answers if r[5] == "/v1/completions"]
    health = sorted(r[1] for r in answers if r[5] == "/health")
    assert len(health) == N_REQUESTS // HEALTH_EVERY and all(
        r[0] == 200 for r in answers if r[5] == "/health"
    )
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) + len(refused) == N_REQUESTS, sorted({r[0] for r in results})
    assert OVERLOAD_QUEUE_LIMIT <= len(ok) < N_REQUESTS
    for _, _, _, data, _, _ in ok:
        c = data["choices"][0]
        assert (
            c["finish_reason"] == "length" and c["text"] and data["usage"]["completion_tokens"] == MAX_TOKENS
        )
    for _, _, retry_after, data, _, _ in refused:
        assert retry_after == "1" and data["error"]["code"] == "queue_full"
    refusals = sorted(r[1] for r in refused)
    p50, health_p50 = refusals[len(refusals) // 2], health[len(health) // 2]
    figures = (
        f"503 p50 {p50 * 1000:.1f} ms, max {refusals[-1] * 1000:.1f} ms; /health in the same burst "
        f"p50 {health_p50 * 1000:.1f} ms, max {health[-1] * 1000:.1f} ms"
    )
    assert p50 <= REFUSAL_PER_HEALTH * health_p50 and refusals[-1] <= REFUSAL_PER_HEALTH * health[-1], figures
    assert stats["max_waiting"] <= OVERLOAD_QUEUE_LIMIT
    assert stats["rss_growth"] < RSS_GROWTH_MB
    assert server.wait_idle()["unfinished"] == 0
    # Only the admitted requests reached the engine; and the server serves as before.
    assert successes(http.get("/metrics").body.decode()) - before_ok == len(ok)
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] >= 1
    print(
        f"\n[overload] {N_REQUESTS} requests in {stats['elapsed']:.1f} s: {len(ok)} served, {len(refused)} "
        f"refused ({figures}); engine queue max {stats['max_waiting']}; RSS +{stats['rss_growth']:.0f} MB"
    )
