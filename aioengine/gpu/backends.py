"""Picks the backend for the engine's device, once, at start: the only place that names both devices."""

from __future__ import annotations

from aioengine.config import EngineArgs, default_num_threads
from aioengine.gpu.backend import Backend


def resolve_device(requested: str) -> str:
    """``auto``: CUDA when torch sees a GPU, else the CPU; any other choice as given."""
    if requested != "auto":
        return requested
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def make_backend(args: EngineArgs, device_index: int = 0) -> Backend:
    """The backend of one tensor-parallel rank: its own GPU, or on CPU its share of the cores."""
    if resolve_device(args.device) == "cuda":
        from aioengine.gpu.cuda.backend import CudaBackend

        return CudaBackend(args.kernels, device_index=device_index)
    from aioengine.gpu.cpu.backend import CpuBackend

    threads = args.num_threads or max(1, default_num_threads() // args.tensor_parallel_size)
    return CpuBackend(args.kernels, threads)
