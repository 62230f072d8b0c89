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
        serve(cfg, reader.recv, reader.record)
    except RingClosed:
        return 0
    return 0


def serve(cfg: Any, recv: Any, record: Any) -> None:
    """Join the group, then run every call ``recv()`` brings on this rank's worker, in order."""
    from aioengine.executor.base import RankWorker
    from aioengine.gpu.backends import make_backend
    from aioengine.gpu.parallel import TPGroup

    backend = make_backend(cfg.args, rank=cfg.rank)
    worker = backend.make_worker()
    group = worker.submit(
        TPGroup, cfg.init_method, cfg.rank, cfg.size, backend.device, cfg.timeout_s
    ).result()
    backend.ops.tp = group
    rank = RankWorker(backend)
    failed: list[BaseException] = []

    def run(method: str, call_args: tuple) -> None:
        try:
            getattr(rank, method)(*call_args)
        except BaseException as e:  # the rank is lost: rank 0 sees it exit
            failed.append(e)
            logger.exception("rank %d: %s failed", cfg.rank, method)
            os._exit(1)
        record(rank.calls, rank.busy_s)

    while not failed:
        method, call_args = recv()
        worker.submit(run, method, call_args)  # the worker runs them in order; the next recv overlaps


if __name__ == "__main__":
    sys.exit(main())
