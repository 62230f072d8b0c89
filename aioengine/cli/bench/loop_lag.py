"""Event-loop lag probe: how late a periodic 1 ms sleep wakes up while the engine works."""

from __future__ import annotations

import asyncio
import contextlib
import time


class LoopLagProbe:
    """Run as a task: records, for each tick, how much later than asked the loop resumed it."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - t0 - self.interval_s))

    def start(self) -> LoopLagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def percentile(self, q: float) -> float:
        if not self.lags:
            return 0.0
        s = sorted(self.lags)
        return s[min(len(s) - 1, int(q * len(s)))]
