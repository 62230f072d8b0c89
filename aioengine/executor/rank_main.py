"""A tensor-parallel rank other than 0, as a process: join the group, then run each call the ring brings.

``python -m aioengine.executor.rank_main`` reads its RankConfig from stdin and keeps stdin open: EOF means
the engine's process is gone (shut down, crashed or killed), and the rank exits at once. It never replies;
rank 0 holds every output.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("aioengine.rank")


def _exit_with_parent(stdin: Any) -> None:
    while stdin.read(1 << 16):
        pass
    os._exit(0)  # the parent closed the pipe or died: no cleanup can be needed that the OS does not do


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(levelname)s %(message)s")
    stdin = sys.stdin.buffer
    cfg = pickle.load(stdin)
    threading.Thread(target=_exit_with_parent, args=(stdin,), name="parent-watch", daemon=True).start()
    from aioengine.executor.shm_ring import RingClosed, RingReader

    reader = RingReader(cfg.ring_path, cfg.rank - 1)  # mapped before the group forms: rank 0 then unlinks it
    try:
        serve(cfg, lambda group: reader.recv, reader.record)
    except RingClosed:
        return 0
    return 0


def serve(
    cfg: Any, transport: Callable[[Any], Callable[[], Any]], record: Callable[[int, float], None]
) -> None:
    """Join the group, then run every call ``transport(group)()`` brings on this rank's worker, in order;
    ``record(steps, busy_s)`` after each call."""
    from aioengine.executor.base import RankWorker
    from aioengine.executor.multiproc import shm_allreduce_bytes
    from aioengine.gpu.backends import make_backend
    from aioengine.gpu.parallel import TPGroup

    backend = make_backend(cfg.args, device_index=cfg.device_index)
    worker = backend.make_worker()
    one_node = cfg.ring_path is not None  # the mp executor's ranks: the ring and the shared all-reduce
    shm_bytes = shm_allreduce_bytes(cfg.args) if one_node else 0
    group = worker.submit(
        TPGroup,
        cfg.init_method,
        cfg.rank,
        cfg.size,
        backend,
        cfg.timeout_s,
        "tp",
        not one_node,
        shm_bytes,
    ).result()
    backend.ops.tp = group
    recv = transport(group)
    rank = RankWorker(backend)

    def run(method: str, call_args: tuple) -> None:
        try:
            getattr(rank, method)(*call_args)
        except BaseException:  # the rank is lost: rank 0 sees it exit
            logger.exception("rank %d: %s failed", cfg.rank, method)
            os._exit(1)
        record(rank.calls, rank.busy_s)

    while True:
        method, call_args = recv()
        worker.submit(run, method, call_args)  # the worker runs them in order; the next recv overlaps


if __name__ == "__main__":
    sys.exit(main())
