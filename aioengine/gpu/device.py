"""Where the runner's work executes: one dedicated worker thread, so the event loop stays free.

On CPU the thread computes each step (torch releases the GIL inside its ops). On CUDA it only launches
kernels on its own stream, which returns as soon as they are queued; the step coroutine then awaits a
CUDA event for the sampled tokens (``aioengine.gpu.async_output``), never a blocking synchronize.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
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

        # Compute yields to the event loop: this thread and the OpenMP threads it spawns (they inherit it) run
        # at a lower priority, so when both want a core the loop wins and answers at once (503s, tokens).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + 5)
        torch.set_num_threads(num_threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class CudaWorker(CpuWorker):
    """The launching thread on CUDA: its current stream is a dedicated compute stream on ``device``."""

    def __init__(self, device_index: int = 0) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioengine-step")
        self.stream = self._pool.submit(self._init_cuda, device_index).result()

    @staticmethod
    def _init_cuda(device_index: int) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False)")
        torch.cuda.set_device(device_index)
        stream = torch.cuda.Stream(device_index)
        torch.cuda.set_stream(stream)  # thread-local: every launch of this worker goes to this stream
        return stream
