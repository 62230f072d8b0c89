"""Time bounds that hold on a slow machine as on a fast one.

A test that claims something is quick does not compare a duration with a constant: the same code on the
same machine runs two or three times slower in a busy hour. It compares with a unit measured in the same
test, on the same machine, under the same load: how many engine steps finished meanwhile (`StepClock`),
one step's duration (`StepClock.median_step_s`), or the round trip of a request that does nothing
(`median_s` of a few `/health` calls). Timeouts that only stop a hang are not claims and stay constants.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from typing import Any

HANG_S = 60.0  # only stops a test that hangs: nothing is asserted about it


def median_s(fn: Callable[[], Any], n: int = 9) -> float:
    """The median duration of n calls of fn(), in seconds."""
    return medians_s([fn], n)[0]


def medians_s(fns: list[Callable[[], Any]], n: int = 9) -> list[float]:
    """The median duration of n calls of each fn, the calls taken in turn (so each sees the same load)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


class StepClock:
    """The perf_counter() time at which each engine step ended, recorded by an engine stat listener.

    The listener runs on the engine's loop after each step it awaited (`AsyncEngine.stat_listeners`); the
    times are perf_counter() values, which on Linux come from CLOCK_MONOTONIC and so compare with those
    taken in other threads and processes (tests/http/loadgen.py).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ends: list[float] = []

    def _on_step(self, stats: Any, outputs: Any) -> None:
        self.ends.append(time.perf_counter())

    def start(self) -> StepClock:
        self.engine.stat_listeners.append(self._on_step)
        return self

    def stop(self) -> None:
        self.engine.stat_listeners.remove(self._on_step)

    def __enter__(self) -> StepClock:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def steps(self) -> int:
        return len(self.ends)

    def steps_between(self, t0: float, t1: float) -> int:
        """How many steps ended in (t0, t1]."""
        ends = list(self.ends)
        return bisect.bisect_right(ends, t1) - bisect.bisect_right(ends, t0)

    def median_step_s(self, t0: float = float("-inf"), t1: float = float("inf")) -> float:
        """The median time from one step's end to the next, over the steps that ended in [t0, t1]: while the
        engine is busy, one step's duration."""
        ends = [t for t in list(self.ends) if t0 <= t <= t1]
        assert len(ends) >= 3, f"{len(ends)} steps ended: too few to time one"
        return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
