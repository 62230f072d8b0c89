"""Picks the backend for the engine's device, once, at start: the only place that names both devices."""

from __future__ import annotations

from aioengine.config import EngineArgs, default_num_threads
from aioengine.gpu.backend import Backend


def make_backend(args: EngineArgs) -> Backend:
    if args.resolved_device() == "cuda":
        from aioengine.gpu.cuda.backend import CudaBackend

        return CudaBackend(args.kernels)
    from aioengine.gpu.cpu.backend import CpuBackend

    return CpuBackend(args.kernels, args.num_threads or default_num_threads())
