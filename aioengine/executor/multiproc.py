"""Tensor parallelism on one node: ranks 1..N-1 are processes this engine spawns, fed by a shared-memory ring.

Rank 0's worker writes each collective call into the ring just before it runs the call itself, so every
rank sees the calls in one order. Each child holds a pipe from this process on its stdin: when this
process dies, however it dies, the pipe closes and the child exits (``rank_main``). A watcher thread per
child turns an exit into EngineDeadError on the loop; shutdown closes the ring, then terminates, then kills.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from aioengine.config import EngineArgs
from aioengine.executor.base import DeathWatch, Executor, RankConfig, RankStats, RankWorker
from aioengine.executor.shm_ring import RingWriter

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
# The largest all-reduce shared memory carries on CPU (a step's hidden states; bigger ones use gloo).
SHM_ALLREDUCE_SLOT_BYTES = (
    64 << 20
)  # the children import torch and join the group: seconds on a loaded machine


class MultiprocExecutor(Executor):
    def __init__(
        self,
        args: EngineArgs,
        worker: Any,
        rank0: RankWorker,
        ring: RingWriter,
        procs: list[subprocess.Popen],
    ) -> None:
        super().__init__(worker, rank0)
        self.tensor_parallel_size = args.tensor_parallel_size
        self.ring = ring
        self.procs = procs
        self.timeout_s = args.step_timeout_s
        self.watch: DeathWatch | None = None
        self._stopping = False
        self.broadcast_s = 0.0  # rank 0's seconds spent writing calls into the ring (pickling included)
        self.broadcast_bytes = 0

    @classmethod
    async def start(cls, args: EngineArgs, backend: Backend, init_method: str) -> MultiprocExecutor:
        """Spawn ranks 1..N-1, then join the group as rank 0 on rank 0's worker thread."""
        from aioengine.gpu.parallel import TPGroup

        size = args.tensor_parallel_size
        ring = RingWriter(num_readers=size - 1)
        procs: list[subprocess.Popen] = []
        worker = None
        try:
            for rank in range(1, size):
                cfg = RankConfig(rank, size, init_method, args, ring.path, args.step_timeout_s, rank)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "aioengine.executor.rank_main"], stdin=subprocess.PIPE
                )
                procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(pickle.dumps(cfg))
                proc.stdin.flush()  # the pipe stays open: its end tells the child we are gone
            self = cls(args, None, RankWorker(backend), ring, procs)
            self.watch = DeathWatch(asyncio.get_running_loop())
            for rank, proc in enumerate(procs, start=1):
                threading.Thread(
                    target=self._watch_child,
                    args=(rank, proc),
                    name=f"aioengine-rank{rank}-watch",
                    daemon=True,
                ).start()
            worker = self.worker = backend.make_worker()
            joined = worker.submit(
                TPGroup,
                init_method,
                0,
                size,
                backend.device,
                max(args.step_timeout_s, START_TIMEOUT_S),
                "tp",
                False,
                SHM_ALLREDUCE_SLOT_BYTES,
            )
            group = await self.watch.race(asyncio.wrap_future(joined))
            backend.ops.tp = group
            ring.unlink()  # every child mapped the ring before it joined
            logger.info("tensor parallelism: %d ranks joined at %s", size, init_method)
            return self
        except BaseException:
            ring.close()
            _reap(procs)
            if worker is not None:
                worker.shutdown()
            ring.release()
            raise

    def _watch_child(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping:
            return
        logger.error("tensor-parallel rank %d exited with code %s", rank, code)
        assert self.watch is not None
        self.watch.report(f"tensor-parallel rank {rank} exited (code {code})")

    def comm_stats(self) -> dict[str, float]:
        group = self.rank0.backend.ops.tp
        return {
            "broadcast_s": self.broadcast_s,
            "broadcast_bytes": float(self.broadcast_bytes),
            "all_reduce_s": group.all_reduce_s if group is not None else 0.0,
            "all_reduce_calls": float(group.all_reduce_calls) if group is not None else 0.0,
        }

    def on_death(self, callback: Any) -> None:
        assert self.watch is not None
        self.watch.callback = callback

    # ---- calls ----------------------------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self.worker.submit(self._broadcast_and_call, method, args)

    def _broadcast_and_call(self, method: str, args: tuple) -> Any:
        t0 = time.perf_counter()
        self.broadcast_bytes += self.ring.publish((method, args), timeout_s=self.timeout_s)
        self.broadcast_s += time.perf_counter() - t0
        return getattr(self.rank0, method)(*args)

    async def output(self, fut: concurrent.futures.Future) -> Any:
        assert self.watch is not None
        return await self.watch.race(self.worker.output(fut))

    def rank_stats(self) -> list[RankStats]:
        stats = super().rank_stats()
        if not self._stopping:
            stats += [RankStats(r, c, b) for r, (c, b) in enumerate(self.ring.reader_stats(), start=1)]
        return stats

    # ---- the end --------------------------------------------------------------------------------
    def kill(self) -> None:
        self._stopping = True
        self.ring.close()
        self._abort_group()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)

    def _abort_group(self) -> None:
        group = self.rank0.backend.ops.tp
        if group is not None:
            group.abort()

    def shutdown(self) -> None:
        self._stopping = True
        self.ring.close()  # a publish waiting on a dead reader gives up
        self._abort_group()  # and so does an all-reduce waiting on one
        _reap(self.procs)  # rank 0's all-reduce with them then fails at once, and its worker is free
        self.worker.shutdown()
        self.ring.release()


def _reap(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Wait for the children to exit; terminate, then kill, those that do not."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # EOF: the child exits at once
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None and sig is not None:
                proc.send_signal(sig)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if all(p.poll() is not None for p in procs):
            return
        deadline = time.monotonic() + grace_s
