"""The engine's one way to reach the model: an Executor runs each call on every rank and hands back rank 0's.

One device: the backend's worker thread, and nothing else (``UniProcExecutor``). Tensor parallelism: rank 0
is that same worker in the engine's process, the other ranks are processes or Ray actors that receive each
call once (``multiproc.py``, ``ray_executor.py``) and meet rank 0 in the model's all-reduces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioengine.config import EngineArgs
from aioengine.errors import EngineDeadError
from aioengine.outputs import RankStats
from aioengine.sched.output import ModelRunnerOutput

if TYPE_CHECKING:  # importing these imports torch
    from aioengine.gpu.backend import Backend, Worker
    from aioengine.gpu.model_runner import ModelRunner


@dataclass(slots=True)
class RankConfig:
    """What a child rank needs to join: pickled onto its stdin."""

    rank: int
    size: int
    init_method: str
    args: EngineArgs
    ring_path: str | None  # None: calls come over torch.distributed (the Ray executor)
    timeout_s: float
    device_index: int  # its GPU (Ray: 0, the one it was given)


class RankWorker:
    """What every rank runs: its backend and, once loaded, its model runner. The executor calls these
    methods by name, in the same order on every rank (the all-reduces inside them line up)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.runner: ModelRunner | None = None
        self.calls = 0
        self.busy_s = 0.0

    def load(self, *runner_args: Any) -> ModelRunner:
        from aioengine.gpu.model_runner import ModelRunner

        model_path, *rest = runner_args
        self.runner = ModelRunner(model_path, self.backend, *rest)
        return self.runner

    def _runner(self) -> ModelRunner:
        assert self.runner is not None, "the rank has no model loaded"
        return self.runner

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner().initialize_kv_cache(num_blocks)

    def initialize_kv_offload(self, num_slots: int) -> None:
        self._runner().initialize_kv_offload(num_slots)

    def load_lora(self, adapter_id: int, name: str, path: str) -> None:
        self._runner().load_lora(adapter_id, name, path)

    def unload_lora(self, adapter_id: int) -> None:
        self._runner().unload_lora(adapter_id)

    def build_fast_paths(self, args: Any, max_num_batched_tokens: int) -> None:
        self.backend.build_fast_paths(self._runner(), args, max_num_batched_tokens)

    def execute_model(self, scheduler_output: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._runner().execute_model(scheduler_output)
        finally:
            self.busy_s += time.perf_counter() - t0

    def sample_tokens(self, grammar_output: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._runner().sample_tokens(grammar_output)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.calls += 1  # one step: its forward and its sampling


class Executor(ABC):
    """How the engine reaches its ranks. Every call goes to rank 0's worker in submission order; a
    ``collective_rpc`` also reaches every other rank, once. Only rank 0's results come back."""

    tensor_parallel_size: int = 1

    def __init__(self, worker: Worker, rank0: RankWorker) -> None:
        self.worker = worker
        self.rank0 = rank0
        self._on_death: Callable[[EngineDeadError], None] | None = None

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> concurrent.futures.Future:
        """``RankWorker.method(*args)`` on every rank; the future of rank 0's result."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """``fn(*args)`` on rank 0's worker alone, after the calls already submitted."""
        return self.worker.submit(fn, *args)

    async def output(self, fut: concurrent.futures.Future) -> ModelRunnerOutput:
        """A step's output, as rank 0's worker awaits it."""
        return await self.worker.output(fut)

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` on the event loop when a rank dies (never called on one device)."""
        self._on_death = callback

    def rank_stats(self) -> list[RankStats]:
        """Each rank's step count and busy seconds (rank 0 first)."""
        return [RankStats(0, self.rank0.calls, self.rank0.busy_s)]

    def comm_stats(self) -> dict[str, float]:
        """Rank 0's tensor-parallel costs so far: seconds and bytes sending calls to the other ranks,
        seconds in all-reduces (empty on one device)."""
        return {}

    def kill(self) -> None:  # noqa: B027 (one device: nothing to kill)
        """The engine died: stop the other ranks now, without waiting (never blocks)."""

    def shutdown(self) -> None:
        """Stop every rank and the worker (blocks; run it off the loop)."""
        self.worker.shutdown()


class UniProcExecutor(Executor):
    """One device: each call is the worker's, straight."""

    def collective_rpc(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self.worker.submit(getattr(self.rank0, method), *args)


class TensorParallelExecutor(Executor):
    """What the executors of several ranks share: each collective call is sent (``_send``, on rank 0's
    worker thread, just before rank 0 runs it), steps are raced against a rank's death, and rank 0 counts
    what the sending and the all-reduces cost."""

    def __init__(self, args: EngineArgs, worker: Any, rank0: RankWorker, watch: DeathWatch) -> None:
        super().__init__(worker, rank0)
        self.tensor_parallel_size = args.tensor_parallel_size
        self.timeout_s = args.step_timeout_s
        self.watch = watch
        self._stopping = False
        self.broadcast_s = 0.0  # rank 0's seconds spent sending calls (pickling included)
        self.broadcast_bytes = 0

    async def _join_as_rank0(
        self, backend: Backend, init_method: str, timeout_s: float, control: bool, shm_bytes: int = 0
    ) -> Any:
        """Make rank 0's worker and join the group on it (it blocks until every rank has joined), unless a
        rank dies first; the backend's layers then all-reduce in that group."""
        from aioengine.gpu.parallel import TPGroup

        self.worker = worker = backend.make_worker()
        size = self.tensor_parallel_size
        joined = worker.submit(TPGroup, init_method, 0, size, backend, timeout_s, "tp", control, shm_bytes)
        group = await self.watch.race(asyncio.wrap_future(joined))
        backend.ops.tp = group
        return group

    def _send(self, call: tuple[str, tuple]) -> int:
        """Send one call to ranks 1..N-1; returns its size in bytes."""
        raise NotImplementedError

    def collective_rpc(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self.worker.submit(self._send_and_call, method, args)

    def _send_and_call(self, method: str, args: tuple) -> Any:
        t0 = time.perf_counter()
        self.broadcast_bytes += self._send((method, args))
        self.broadcast_s += time.perf_counter() - t0
        return getattr(self.rank0, method)(*args)

    async def output(self, fut: concurrent.futures.Future) -> ModelRunnerOutput:
        result: ModelRunnerOutput = await self.watch.race(self.worker.output(fut))
        return result

    def on_death(self, callback: Callable[[EngineDeadError], None]) -> None:
        self.watch.callback = callback

    def _rank_died(self, message: str) -> None:
        """From a watcher thread: rank 0's all-reduces can never complete now (one in progress gives up),
        and the engine learns why."""
        if self._stopping:
            return
        self._abort_group()
        self.watch.report(message)

    def _abort_group(self) -> None:
        group = self.rank0.backend.ops.tp
        if group is not None:
            group.abort()

    def comm_stats(self) -> dict[str, float]:
        group = self.rank0.backend.ops.tp
        return {
            "broadcast_s": self.broadcast_s,
            "broadcast_bytes": float(self.broadcast_bytes),
            "all_reduce_s": group.all_reduce_s if group is not None else 0.0,
            "all_reduce_calls": float(group.all_reduce_calls) if group is not None else 0.0,
        }


class DeathWatch:
    """Turns a rank's death, seen on any thread, into an error on the loop: it fails the step being
    awaited at once (no wait for the watchdog) and tells the engine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[EngineDeadError] = loop.create_future()
        self.callback: Callable[[EngineDeadError], None] | None = None

    def report(self, message: str) -> None:
        """From any thread: the first report wins (none once the loop is gone)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._set, EngineDeadError(message))

    def _set(self, err: EngineDeadError) -> None:
        if self.future.done():
            return
        self.future.set_result(err)
        if self.callback is not None:
            self.callback(err)

    async def race(self, awaitable: Any) -> Any:
        """``await awaitable``, unless a rank dies first (then EngineDeadError)."""
        if self.future.done():
            raise self.future.result()
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait((task, self.future), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise self.future.result()
