"""Executors: how the engine's calls reach one device, or every rank of a tensor-parallel group."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioengine import env
from aioengine.config import EngineArgs
from aioengine.executor.base import Executor, RankStats, RankWorker, UniProcExecutor

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend

__all__ = ["Executor", "RankStats", "RankWorker", "UniProcExecutor", "make_executor"]


async def make_executor(args: EngineArgs, backend: Backend) -> Executor:
    """One device: the backend's worker. TP > 1: spawn (mp) or place (ray) ranks 1..N-1 and join them."""
    if args.tensor_parallel_size == 1:
        return UniProcExecutor(backend.make_worker(), RankWorker(backend))
    from aioengine.gpu.parallel import resolve_init_method

    given = args.distributed_init_method is not None or env.torchrun_master_given()
    init_method = resolve_init_method(args.distributed_init_method) if given else None
    if args.distributed_executor_backend == "ray":
        from aioengine.executor.ray_executor import RayExecutor

        return await RayExecutor.start(args, backend, init_method)
    init_method = init_method or resolve_init_method(None)
    from aioengine.executor.multiproc import MultiprocExecutor

    return await MultiprocExecutor.start(args, backend, init_method)
