"""The CPU's worker: one thread computes every runner call in submission order (it plays a CUDA stream).

torch's ops and the C kernels release the GIL, so the event loop keeps serving while a step computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from aioengine.sched.output import ModelRunnerOutput

_NICE = 10  # the compute threads' priority below the loop's
# One CPU: the engines of one process (a server's several models) take turns on its cores, a call at a time;
# two OpenMP teams at once would each get half the cores and both wait on the slower one's barriers.
_CORES = threading.Lock()
_STEP_CALLS = frozenset({"execute_model", "sample_tokens"})  # RankWorker's per-step calls


class CpuWorker:
    def __init__(self, num_threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioengine-step")
        self._pool.submit(self._init_thread, num_threads).result()

    @staticmethod
    def _init_thread(num_threads: int) -> None:
        import torch

        # Compute yields to the event loop: this thread and the OpenMP threads it spawns (they inherit it) run
        # at a lower priority, so when both want a core the loop wins and answers at once (503s, tokens).
        # At +10 rather than +5 the loop's bursts held fewer streams' tokens back (docs/benchmarks.md).
        with contextlib.suppress(OSError, AttributeError):
            nice = os.getpriority(os.PRIO_PROCESS, 0) + _NICE
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        torch.set_num_threads(num_threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if getattr(fn, "__name__", "") in _STEP_CALLS:
            return self._pool.submit(_on_the_cores, fn, *args)
        return self._pool.submit(fn, *args)  # a load, a KV cache set-up: the other models keep stepping

    async def output(self, fut: concurrent.futures.Future) -> ModelRunnerOutput:
        """A step's output: on the CPU the worker's result is the output itself."""
        return await asyncio.wrap_future(fut)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _on_the_cores(fn: Callable[..., Any], *args: Any) -> Any:
    with _CORES:
        return fn(*args)
