"""The CUDA worker: a thread that only launches kernels on its own compute stream, and returns at once.

A step's result is an AsyncOutput whose device-to-host copy is in flight; awaiting it waits for a CUDA
event without blocking the loop (``aioengine.gpu.cuda.async_output``), never a blocking synchronize.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

from aioengine.gpu.cpu.worker import CpuWorker
from aioengine.gpu.cuda.async_output import AsyncOutput
from aioengine.sched.output import ModelRunnerOutput


class CudaWorker(CpuWorker):
    """The launching thread: its current stream is a dedicated compute stream on ``device_index``."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)  # streams of their own: no turns with other engines' steps

    def __init__(self, device_index: int = 0) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioengine-step")
        self.stream = self._pool.submit(self._init_cuda, device_index).result()

    @staticmethod
    def _init_cuda(device_index: int) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is False)"
            )
        torch.cuda.set_device(device_index)
        stream = torch.cuda.Stream(device_index)
        torch.cuda.set_stream(stream)  # thread-local: every launch of this worker goes to this stream
        return stream

    async def output(self, fut: concurrent.futures.Future) -> ModelRunnerOutput:
        """The worker returns an AsyncOutput (a step that samples) or a plain output (one that does not)."""
        out = await asyncio.wrap_future(fut)
        if isinstance(out, AsyncOutput):
            out = await out
        return out
