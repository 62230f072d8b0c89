"""Tensor parallelism across nodes: ranks 1..N-1 are Ray actors in a placement group of N bundles.

Rank 0 stays in the engine's process (bundle 0 is reserved for it), so the step coroutine still awaits only
its own worker. Each collective call goes to the actors over a gloo control group (torch.distributed, which
crosses nodes), written by rank 0's worker just before it runs the call. An actor's death ends its ``run``
task, which a watcher thread turns into EngineDeadError. Ray is an optional extra (``pip install
'aioengine[ray]'``); the engine connects to a running cluster (RAY_ADDRESS), or starts a local one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from aioengine.config import EngineArgs
from aioengine.executor.base import DeathWatch, RankConfig, RankStats, RankWorker, TensorParallelExecutor
from aioengine.executor.multiproc import START_TIMEOUT_S

if TYPE_CHECKING:
    from aioengine.gpu.backend import Backend

logger = logging.getLogger(__name__)


class _RankActor:
    """One rank in a Ray worker process. ``run`` holds the actor until the engine ends it; ``stats`` answers
    beside it (the actor runs two calls at once)."""

    def __init__(self) -> None:
        self.steps, self.busy_s = 0, 0.0

    def run(self, cfg: RankConfig) -> None:
        from aioengine.executor.rank_main import serve

        def record(steps: int, busy_s: float) -> None:
            self.steps, self.busy_s = steps, busy_s

        serve(cfg, lambda group: group.recv_object, record)

    def stats(self) -> tuple[int, float]:
        return self.steps, self.busy_s


class RayExecutor(TensorParallelExecutor):
    def __init__(self, args: EngineArgs, worker: Any, rank0: RankWorker, watch: DeathWatch) -> None:
        super().__init__(args, worker, rank0, watch)
        self.actors: list[Any] = []
        self.placement_group: Any = None
        self.group: Any = None
        self._stats: list[RankStats] = []

    @classmethod
    async def start(cls, args: EngineArgs, backend: Backend, init_method: str | None) -> RayExecutor:
        """``init_method`` None: a free port at this node's address, which the other nodes can reach."""
        try:
            import ray
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise RuntimeError(
                "distributed_executor_backend 'ray' needs Ray: pip install 'aioengine[ray]'"
            ) from None
        size = args.tensor_parallel_size
        self = cls(args, None, RankWorker(backend), DeathWatch(asyncio.get_running_loop()))
        loop = asyncio.get_running_loop()
        try:
            if not ray.is_initialized():
                await loop.run_in_executor(None, lambda: ray.init(ignore_reinit_error=True))
            bundle = dict(backend.ray_bundle)
            self.placement_group = ray.util.placement_group(
                [dict(bundle) for _ in range(size)], strategy="PACK"
            )
            await loop.run_in_executor(
                None, lambda: ray.get(self.placement_group.ready(), timeout=START_TIMEOUT_S)
            )
            actor_cls = ray.remote(_RankActor)
            for rank in range(1, size):
                strategy = PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                )
                options: dict[str, Any] = {
                    "scheduling_strategy": strategy,
                    "num_cpus": bundle.get("CPU", 1.0),
                    "max_concurrency": 2,
                }
                if "GPU" in bundle:
                    options["num_gpus"] = bundle["GPU"]
                self.actors.append(actor_cls.options(**options).remote())
            if init_method is None:
                from aioengine.gpu.parallel import free_port

                init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"
            runs = []
            for rank, actor in enumerate(self.actors, start=1):
                # The actor's own GPU is its device 0 (Ray sets CUDA_VISIBLE_DEVICES).
                cfg = RankConfig(rank, size, init_method, args, None, args.step_timeout_s, 0)
                runs.append(actor.run.remote(cfg))
            threading.Thread(
                target=self._watch, args=(runs,), name="aioengine-ray-watch", daemon=True
            ).start()
            timeout_s = max(args.step_timeout_s, START_TIMEOUT_S)
            self.group = await self._join_as_rank0(backend, init_method, timeout_s, True)
            threading.Thread(target=self._poll_stats, name="aioengine-ray-stats", daemon=True).start()
            logger.info("tensor parallelism: %d ranks (Ray actors) joined at %s", size, init_method)
            return self
        except BaseException:
            self.kill()
            if self.worker is not None:
                self.worker.shutdown()
            raise

    def _watch(self, runs: list[Any]) -> None:
        import ray

        ready, _ = ray.wait(runs, num_returns=1, timeout=None)
        if self._stopping:
            return
        rank = runs.index(ready[0]) + 1
        try:
            ray.get(ready[0])
            why = "returned"
        except Exception as e:  # RayActorError when the actor died
            why = f"died: {type(e).__name__}"
        logger.error("tensor-parallel rank %d (Ray actor) %s", rank, why)
        self._rank_died(f"tensor-parallel rank {rank} exited (Ray actor {why})")

    def _poll_stats(self) -> None:
        """The metrics read rank stats on the loop: they are fetched here, never awaited there."""
        import ray

        while not self._stopping:
            try:
                got = ray.get([a.stats.remote() for a in self.actors], timeout=5)
                self._stats = [RankStats(r, c, b) for r, (c, b) in enumerate(got, start=1)]
            except Exception:  # noqa: BLE001 (a dead actor: the watcher reports it)
                return
            time.sleep(1.0)

    def _send(self, call: tuple[str, tuple]) -> int:
        return int(self.group.send_object(call))

    def rank_stats(self) -> list[RankStats]:
        return super().rank_stats() + list(self._stats)

    def kill(self) -> None:
        import ray

        self._stopping = True
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                logger.debug("ray.kill failed", exc_info=True)
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                logger.debug("remove_placement_group failed", exc_info=True)
            self.placement_group = None

    def shutdown(self) -> None:
        self.kill()  # rank 0's pending all-reduce with them fails at once, and its worker is free
        self.worker.shutdown()
