"""How long the GPU sat idle between engine steps, from CUDA events on the compute stream.

Each step records an event just before its forward is queued and one after its sampling. The GPU
timestamps an event when it reaches it, so ``end[k] -> start[k+1]`` is the time the GPU waited for the
host to queue step k+1 (zero when step k+1 was queued while step k still ran: async scheduling's goal),
and ``start[k] -> end[k]`` is the step's device time. Events are read only once complete (``query()``),
so recording and harvesting never block.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class IdleStats:
    steps: int = 0
    busy_ms: float = 0.0
    idle_ms: float = 0.0
    # The same sums per kind of step (the runner's labels: "decode_graph", "decode_eager", "mixed"); the idle
    # gap before a step counts for that step's kind.
    by_kind: dict[str, IdleStats] = field(default_factory=dict)

    @property
    def idle_fraction(self) -> float:
        total = self.busy_ms + self.idle_ms
        return self.idle_ms / total if total > 0 else 0.0

    def add(self, kind: str, busy_ms: float, idle_ms: float) -> None:
        for s in (self, self.by_kind.setdefault(kind, IdleStats())):
            s.steps += 1
            s.busy_ms += busy_ms
            s.idle_ms += idle_ms

    def as_dict(self) -> dict[str, float]:
        d = {
            "gpu_steps": self.steps,
            "gpu_busy_ms": self.busy_ms,
            "gpu_idle_ms": self.idle_ms,
            "gpu_idle_fraction": self.idle_fraction,
        }
        for kind, s in sorted(self.by_kind.items()):
            d[f"gpu_steps_{kind}"] = s.steps
            d[f"gpu_busy_ms_{kind}"] = s.busy_ms
            d[f"gpu_idle_fraction_{kind}"] = s.idle_fraction
        return d


class GpuTimeline:
    """``start()`` / ``end()`` around each step on the launching thread; ``stats()`` sums completed steps.

    ``make_event`` builds a timing event (``torch.cuda.Event(enable_timing=True)`` by default; tests pass
    fakes with ``record()``, ``query()``, ``synchronize()`` and ``elapsed_time(other)``).
    """

    def __init__(self, make_event: Any = None) -> None:
        if make_event is None:
            import torch

            def make_event() -> Any:
                return torch.cuda.Event(enable_timing=True)

        self._make_event = make_event
        self._open: Any = None
        self._pending: collections.deque = collections.deque()
        self._last_end: Any = None
        self._stats = IdleStats()

    def start(self, kind: str = "step") -> None:
        ev = self._make_event()
        ev.record()
        self._open = (ev, kind)

    def end(self) -> None:
        if self._open is None:
            return
        ev = self._make_event()
        ev.record()
        self._pending.append((*self._open, ev))
        self._open = None
        self._harvest(wait=False)

    def _harvest(self, wait: bool) -> None:
        stats = self._stats
        while self._pending:
            start, kind, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            idle = 0.0 if self._last_end is None else max(0.0, self._last_end.elapsed_time(start))
            stats.add(kind, start.elapsed_time(end), idle)
            self._last_end = end

    def reset(self) -> None:
        """Start a new measurement window (the first step after it has no idle time before it)."""
        self._harvest(wait=True)
        self._last_end = None
        self._stats = IdleStats()

    def stats(self, wait: bool = True) -> IdleStats:
        """Totals over the completed steps (all recorded steps when ``wait``: blocks the calling thread)."""
        self._harvest(wait)
        return copy.deepcopy(self._stats)
