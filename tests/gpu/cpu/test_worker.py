"""The CPU worker's thread computes below the event loop's priority, so a contended core goes to the loop."""

from __future__ import annotations

import os
import threading

from aioengine.gpu.cpu.worker import CpuWorker


def _nice_and_thread() -> tuple[int, int]:
    return os.getpriority(os.PRIO_PROCESS, 0), threading.get_native_id()  # 0: the calling thread, on Linux


def test_the_worker_thread_runs_ten_nice_levels_below_its_creator():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    worker = CpuWorker(1)
    try:
        nice, tid = worker.submit(_nice_and_thread).result()
    finally:
        worker.shutdown()
    assert tid != threading.get_native_id()
    assert nice == min(mine + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # the caller's own priority is untouched
