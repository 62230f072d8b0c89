"""The engine's side of the KV offload tier's disk reads: each read a task of its own, never inside a step."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from aioengine.engine.kv_disk import KVDiskTier
from aioengine.sched.kv_offload import DiskRead, OffloadTier

logger = logging.getLogger(__name__)


class DiskReads:
    def __init__(
        self,
        disk: KVDiskTier,
        tier: OffloadTier,
        submit: Callable[..., concurrent.futures.Future],
        fill: Callable[[int, bytes], None],
        wake: Callable[[], None],
    ) -> None:
        """``submit(fn, *args)``: run on rank 0's worker behind the steps already submitted; ``fill(slot,
        bytes)``: the host tier's; ``wake()``: the step loop's, when a read lands (its request may go)."""
        self.disk, self.tier, self.submit, self.fill, self.wake = disk, tier, submit, fill, wake
        self.tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        """The reads the last schedule started."""
        for read in self.tier.take_reads():
            task = asyncio.create_task(self._read(read))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _read(self, read: DiskRead) -> None:
        ok = False
        try:
            # (the tier only reads blocks whose step ran: their writes are ahead of this on the I/O thread)
            payload = await asyncio.wrap_future(self.disk.read(*read.key, read.token_ids))
            if payload is not None:  # into its slot on the worker: no step still reads the slot's old block
                await asyncio.wrap_future(self.submit(self.fill, read.slot, payload))
                ok = True
        except Exception:
            logger.exception("KV disk tier: a block read failed; its tokens are computed again")
        finally:
            if read.key in self.tier.arriving:
                self.tier.read_done(read.key, ok)
            self.wake()

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()
