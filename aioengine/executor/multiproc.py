"""Tensor parallelism on one node: ranks 1..N-1 are processes this engine spawns, fed by a shared-memory ring.

Rank 0's worker writes each collective call into the ring just before it runs the call itself, so every
rank sees the calls in one order. Each child holds a pipe from this process on its stdin: when this
process dies, however it dies, the pipe closes and the child exits (``rank_main``). A watcher thread per
child turns an exit into EngineDeadError on the loop; shutdown closes the ring, then terminates, then kills.
"""

from __future__ import annotations

import asyncio
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
from aioengine.executor.base import DeathWatch, RankConfig, RankStats, RankWorker, TensorParallelExecutor
from aioengine.executor.shm_ring import RingWriter

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
# The largest all-reduce shared memory carries on CPU (a step's hidden states; bigger ones use gloo).
SHM_ALLREDUCE_SLOT_BYTES = (
    64 << 20
)  # the children import torch and join the group: seconds on a loaded machine


class MultiprocExecutor(TensorParallelExecutor):
    def __init__(
        self,
        args: EngineArgs,
        worker: Any,
        rank0: RankWorker,
        watch: DeathWatch,
        ring: RingWriter,
        procs: list[subprocess.Popen],
    ) -> None:
        super().__init__(args, worker, rank0, watch)
        self.ring = ring
        self.procs = procs

    @classmethod
    async def start(cls, args: EngineArgs, backend: Backend, init_method: str) -> MultiprocExecutor:
        """Spawn ranks 1..N-1, then join the group as rank 0 on rank 0's worker thread."""
        size = args.tensor_parallel_size
        backend.check_tensor_parallel_size(size)
        ring = RingWriter(num_readers=size - 1)
        procs: list[subprocess.Popen] = []
        self: MultiprocExecutor | None = None
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
            self = cls(args, None, RankWorker(backend), DeathWatch(asyncio.get_running_loop()), ring, procs)
            for rank, proc in enumerate(procs, start=1):
                threading.Thread(
                    target=self._watch_child,
                    args=(rank, proc),
                    name=f"aioengine-rank{rank}-watch",
                    daemon=True,
                ).start()
            timeout_s = max(args.step_timeout_s, START_TIMEOUT_S)
            await self._join_as_rank0(backend, init_method, timeout_s, False, shm_allreduce_bytes(args))
            ring.unlink()  # every child mapped the ring before it joined
            logger.info("tensor parallelism: %d ranks joined at %s", size, init_method)
            return self
        except BaseException:
            ring.close()
            _reap(procs)
            if self is not None and self.worker is not None:
                self.worker.shutdown()
            ring.release()
            raise

    def _watch_child(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping:
            logger.error("tensor-parallel rank %d exited with code %s", rank, code)
        self._rank_died(f"tensor-parallel rank {rank} exited (code {code})")

    def _send(self, call: tuple[str, tuple]) -> int:
        return self.ring.publish(call, timeout_s=self.timeout_s)

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

    def shutdown(self) -> None:
        self._stopping = True
        self.ring.close()  # a publish waiting on a dead reader gives up
        self._abort_group()  # and so does an all-reduce waiting on one
        _reap(self.procs)  # rank 0's all-reduce with them then fails at once, and its worker is free
        self.worker.shutdown()
        self.ring.release()


def shm_allreduce_bytes(args: EngineArgs) -> int:
    """The shared-memory all-reduce's slot size for this engine's ranks (0: gloo only)."""
    return SHM_ALLREDUCE_SLOT_BYTES if args.kernels.cpu_shm_allreduce else 0


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
