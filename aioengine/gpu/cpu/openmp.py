"""libgomp's thread pools: the CPU worker should be the process's only OpenMP master, and this keeps it so.

Every thread that runs a parallel region (a torch op, a C kernel) gets a pool of its own, and libgomp counts
the threads of all pools together: once they outnumber the CPUs, every wait spins about a hundred times
instead of some milliseconds, then sleeps in the kernel. The worker's threads then sleep and wake at every
barrier of every kernel (what that costs: docs/benchmarks.md, issue 23). A thread gives its pool back when
it exits, or here, through OpenMP 5's ``omp_pause_resource_all``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import resource
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("aioengine.cpu")

_OMP_PAUSE_SOFT = 1
# A decode-stack call (every layer in one C call) whose thread sleeps this often on average waits at
# throttled barriers: unthrottled it sleeps at most once (taking the GIL back at the end), throttled at
# about every parallel region (several a layer). Counted around that call only: the worker's Python also
# sleeps when it waits for the GIL, as often as the switch interval makes it.
_SLEEPS_PER_CALL = 4.0
_WINDOW = 32  # calls averaged before the check


@functools.cache
def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp this process has loaded: torch's copy, and any other package's vendored one (each is a
    runtime with pools of its own). Empty where none is, or /proc is not there."""
    try:
        with open("/proc/self/maps") as f:
            paths = dict.fromkeys(line.split()[-1] for line in f if "/libgomp" in line)
    except OSError:
        return ()
    libs = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # already mapped: the same library, one more reference
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
            continue
        libs.append(lib)
    return tuple(libs)


def release_thread_pool() -> bool:
    """Give back the calling thread's OpenMP pools, if it has any (its next parallel region makes a new
    one). Call it on a thread that has run torch work beside a running engine. False where this process
    has no libgomp that can."""
    results = [lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0 for lib in _libgomps()]
    return bool(results) and all(results)


def thread_sleeps() -> int:
    """The calling thread's voluntary context switches so far: each is a wait that went to the kernel."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


class SleepWatch:
    """Counts a thread's sleeps in calls that run many parallel regions, and warns once when they show
    throttled OpenMP barriers."""

    def __init__(self) -> None:
        self.calls = 0
        self.sleeps = 0
        self.warned = False

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its thread's sleeps counted."""
        before = thread_sleeps()
        try:
            return fn(*args)
        finally:
            self.record(thread_sleeps() - before)

    def record(self, sleeps: int) -> None:
        self.calls += 1
        self.sleeps += sleeps
        if self.calls < _WINDOW:
            return
        mean, self.calls, self.sleeps = self.sleeps / self.calls, 0, 0
        if mean > _SLEEPS_PER_CALL and not self.warned:
            self.warned = True
            logger.warning(
                "the CPU worker slept %.0f times in each decode step: another thread of this process has run "
                "OpenMP work (torch ops), and libgomp throttles every pool's waits while their threads "
                "outnumber the CPUs, which can halve the engine's speed. Call "
                "aioengine.gpu.cpu.openmp.release_thread_pool() on that thread after its torch work.",
                mean,
            )
