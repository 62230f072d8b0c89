"""One OpenMP master per process: a pool of another thread's throttles the worker's waits; the engine gives
the starting thread's back, and the worker's watch reports the rest."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aioengine.gpu.cpu.openmp import _SLEEPS_PER_CALL, _WINDOW, SleepWatch

_REPO = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter: pools that other tests' threads left in this one would throttle it whatever
# the engine does. ``regions`` runs back-to-back parallel torch ops on the worker and returns its sleeps per
# op: about none while it is the only OpenMP master, one or more per op once libgomp throttles.
_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import torch
    from aioengine import AsyncEngine, EngineArgs
    from aioengine.gpu.cpu.openmp import thread_sleeps

    def regions(n=400):
        a, b = torch.ones(1 << 20), torch.ones(1 << 20)
        torch.add(a, b, out=a)
        before = thread_sleeps()
        for _ in range(n):
            torch.add(a, b, out=a)
        return (thread_sleeps() - before) / n

    async def main(path):
        torch.ones(1 << 20).add_(1)  # this thread's own pool, before the engine starts
        engine = AsyncEngine(EngineArgs(model=path, max_model_len=256, num_threads=2))
        await engine.start()
        released = await engine.run_on_worker(regions)
        torch.ones(1 << 20).add_(1)  # after start: the pool is back, and stays
        throttled = await engine.run_on_worker(regions)
        await engine.shutdown()
        print(released, throttled)

    asyncio.run(main(sys.argv[1]))
    """
)


@pytest.mark.serial
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: OpenMP makes no pools to throttle")
def test_engine_start_gives_the_starting_threads_pool_back(tmp_path):
    from tests.engine.conftest import make_tiny_checkpoint

    make_tiny_checkpoint("llama", tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=_REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    released, throttled = map(float, out.stdout.split()[-2:])
    # the control shows the test can tell: with the starting thread's pool back, every op sleeps
    assert throttled > 0.3, (released, throttled)
    assert released < 0.1, (released, throttled)


def test_the_watch_warns_once_when_calls_sleep_at_throttled_barriers(caplog):
    watch = SleepWatch()
    with caplog.at_level(logging.WARNING, logger="aioengine.cpu"):
        for _ in range(3 * _WINDOW):  # a healthy worker: a few sleeps a step
            watch.record(1)
        assert not caplog.records
        for _ in range(2 * _WINDOW):
            watch.record(int(_SLEEPS_PER_CALL) * 5)
    assert len(caplog.records) == 1 and "release_thread_pool" in caplog.records[0].getMessage()


def test_the_watch_counts_the_calls_sleeps_and_passes_results_and_errors_through():
    watch = SleepWatch()
    assert watch.run(lambda x: x + 1, 1) == 2
    with pytest.raises(ZeroDivisionError):
        watch.run(lambda: 1 / 0)
    assert watch.calls == 2
