"""Soak (tests/http/soak.py): a random mix of requests for a while. No 5xx, no wrong answer, nothing left
in the engine afterwards, and the event loop stays responsive (lag p99 under half of one engine step, the
step timed in the same soak: a forward on the loop would stall it for a whole step at every step). The short
form runs in the normal suite; the long one is `AIOENGINE_SOAK_S=180 python -m pytest -m slow
tests/http/test_soak.py`.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from aioengine.cli.bench.loop_lag import LoopLagProbe
from tests.http.soak import SoakReport, soak
from tests.timing import StepClock

pytestmark = pytest.mark.serial  # it measures timing or load: it runs alone

SHORT_S = 15.0
LONG_S = float(os.environ.get("AIOENGINE_SOAK_S", "180"))
LAG_P99_PER_STEP = 0.5
EMPTY = {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}


def run_soak(server, duration_s: float, seed: int) -> tuple[SoakReport, float]:
    """The soak against the "main" app, with a loop-lag probe on the server's loop: (report, lag p99)."""

    async def start_probe() -> LoopLagProbe:
        return LoopLagProbe().start()

    clock = server.call(StepClock(server.engine).start)
    probe = server.run(start_probe())
    try:
        report = asyncio.run(soak(server.url(), duration_s, seed=seed))
    finally:
        server.run(probe.stop())
        server.call(clock.stop)
    lag_p99, step_s = probe.percentile(0.99), clock.median_step_s()
    bound = LAG_P99_PER_STEP * step_s
    print(
        f"\n[soak {duration_s:.0f} s] {report.summary()}; loop lag p99 {lag_p99 * 1000:.1f} ms, "
        f"max {max(probe.lags, default=0) * 1000:.0f} ms, {sum(lag > bound for lag in probe.lags)} of "
        f"{len(probe.lags)} ticks over half a step ({step_s * 1000:.1f} ms, median of {clock.steps})"
    )
    assert report.server_errors == 0, report.errors
    assert not report.errors, report.errors
    assert set(report.requests) == set(report.latencies)  # every kind ran and was answered at least once
    assert server.wait_idle() == EMPTY  # no leaked request or KV block
    assert lag_p99 < bound, f"loop lag p99 {lag_p99 * 1000:.1f} ms, one step {step_s * 1000:.1f} ms"
    return report, lag_p99


def test_soak_short(server):
    run_soak(server, SHORT_S, seed=1)


@pytest.mark.slow
def test_soak_long(server):
    run_soak(server, LONG_S, seed=2)
