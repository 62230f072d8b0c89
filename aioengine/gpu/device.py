"""Where the runner's work executes: one dedicated worker thread on CPU, so the event loop stays free."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any


class CpuWorker:
    """A single thread runs every runner call in submission order: it plays the role of a CUDA stream.

    torch releases the GIL inside its ops, so the event loop keeps serving while a step computes.
    """

    def __init__(self, num_threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioengine-step")
        self._pool.submit(self._init_thread, num_threads).result()

    @staticmethod
    def _init_thread(num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
