"""A shared-memory broadcast ring on one node: rank 0 writes each step's call once, every other rank reads it.

One writer and N readers share a file in /dev/shm, mapped by each. The writer fills a slot, then publishes
its sequence number; a reader copies the slot out, then advances its own counter, which frees the slot
once every reader has passed it. A message larger than a slot spans consecutive slots. Waits poll with a
backoff that ends at a millisecond, so an idle reader costs next to no CPU and a busy one answers within
microseconds. (The counters are aligned 8-byte words, which x86-64 stores and loads whole and in order.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import tempfile
import time
import uuid
from typing import Any

import numpy as np

_HEADER_WORDS = 8  # magic, slots, slot bytes, readers, closed, (reserved)
_MAGIC = 0x61696F72696E6701
_SLOT_HEADER = 16  # sequence number + 1 (0: never written), then length | MORE
_MORE = 1 << 62  # the message goes on in the next slot
_STATS = 4  # per reader: messages handled, seconds busy, (reserved)


class RingClosed(Exception):
    """The writer closed the ring: the engine is shutting down."""


class RingTimeout(TimeoutError):
    """A wait on the ring outlasted its limit (a reader stopped reading, or no message came)."""


def _wait(ready: Any, timeout_s: float | None, what: str) -> None:
    """Poll ``ready()``: a few hundred yields first, then sleeps doubling from 50 us to 1 ms."""
    for _ in range(200):
        if ready():
            return
        time.sleep(0)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 50e-6
    while not ready():
        if deadline is not None and time.monotonic() > deadline:
            raise RingTimeout(f"{what} for more than {timeout_s} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Ring:
    def __init__(self, path: str, size: int | None = None) -> None:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
        try:
            if size is not None:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.path = path
        self.header = np.ndarray((_HEADER_WORDS,), np.int64, self.mm, 0)

    def _layout(self) -> None:
        self.num_slots, self.slot_bytes, self.num_readers = (int(x) for x in self.header[1:4])
        off = _HEADER_WORDS * 8
        self.read_counts = np.ndarray((self.num_readers,), np.int64, self.mm, off)
        off += self.num_readers * 8
        self.stats = np.ndarray((self.num_readers, _STATS), np.float64, self.mm, off)
        off += self.num_readers * _STATS * 8
        self.slot_seq = np.ndarray((self.num_slots, 2), np.int64, self.mm, off)
        off += self.num_slots * _SLOT_HEADER
        self.data_offset = off
        self.view = memoryview(self.mm)

    def _slot(self, seq: int) -> tuple[int, int]:
        """(slot index, byte offset of its data)."""
        i = seq % self.num_slots
        return i, self.data_offset + i * self.slot_bytes

    @property
    def closed(self) -> bool:
        return bool(self.header[4])

    def detach(self) -> None:
        for name in ("header", "read_counts", "stats", "slot_seq"):
            self.__dict__.pop(name, None)
        self.view.release()
        self.mm.close()


class RingWriter(_Ring):
    """Rank 0's end: ``publish`` a picklable object to every reader."""

    def __init__(self, num_readers: int, num_slots: int = 16, slot_bytes: int = 1 << 20) -> None:
        assert num_readers >= 1 and num_slots >= 2 and slot_bytes % 8 == 0
        path = os.path.join(_shm_dir(), f"aioengine-ring-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        meta = (_HEADER_WORDS + num_readers * (1 + _STATS)) * 8 + num_slots * _SLOT_HEADER
        super().__init__(path, meta + num_slots * slot_bytes)
        self.header[:4] = (_MAGIC, num_slots, slot_bytes, num_readers)
        self._layout()
        self.count = 0  # chunks written
        self.unlinked = False
        self.closing = False

    def publish(self, obj: Any, timeout_s: float | None = None) -> int:
        """Write ``obj`` for every reader; returns its size in bytes. Waits (up to ``timeout_s``) while the
        slowest reader still holds the slot it needs."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n, start = len(data), 0
        while True:
            seq = self.count
            free = seq - self.num_slots
            if int(self.read_counts.min()) <= free:
                _wait(
                    lambda f=free: self.closing or int(self.read_counts.min()) > f,
                    timeout_s,
                    "a reader held the ring",
                )
                if self.closing:
                    raise RingClosed()
            i, off = self._slot(seq)
            chunk = min(self.slot_bytes, n - start)
            self.view[off : off + chunk] = data[start : start + chunk]
            start += chunk
            self.slot_seq[i, 1] = chunk | (_MORE if start < n else 0)
            self.slot_seq[i, 0] = seq + 1  # last: the slot is now readable
            self.count = seq + 1
            if start >= n:
                return n

    def reader_stats(self) -> list[tuple[float, float]]:
        """Each reader's (messages handled, seconds busy), as it last recorded them."""
        return [(float(a), float(b)) for a, b in self.stats[:, :2]]

    def unlink(self) -> None:
        """Remove the file once every reader has mapped it (the mappings stay): nothing is left behind."""
        if not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Tell the readers to stop and a waiting ``publish`` to give up (from any thread)."""
        self.closing = True
        self.header[4] = 1

    def release(self) -> None:
        """Unmap the ring (once nothing publishes any more)."""
        self.close()
        self.unlink()
        self.detach()


class RingReader(_Ring):
    """Rank r's end (``index`` = r - 1): ``recv`` the next object, in the order it was published."""

    def __init__(self, path: str, index: int) -> None:
        super().__init__(path)
        if int(self.header[0]) != _MAGIC:
            raise ValueError(f"{path} is not an aioengine ring")
        self._layout()
        assert 0 <= index < self.num_readers
        self.index = index
        self.count = 0

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next object; raises RingClosed once the writer closed the ring and nothing is left."""
        parts = []
        while True:
            seq = self.count
            i, off = self._slot(seq)
            if int(self.slot_seq[i, 0]) != seq + 1:
                _wait(
                    lambda i=i, s=seq + 1: int(self.slot_seq[i, 0]) == s or self.closed,
                    timeout_s,
                    "no message came",
                )
                if int(self.slot_seq[i, 0]) != seq + 1:
                    raise RingClosed()
            word = int(self.slot_seq[i, 1])
            length = word & (_MORE - 1)
            parts.append(bytes(self.view[off : off + length]))
            self.count = seq + 1
            self.read_counts[self.index] = self.count  # after the copy: the writer may reuse the slot now
            if not word & _MORE:
                return pickle.loads(parts[0] if len(parts) == 1 else b"".join(parts))

    def record(self, handled: int, busy_s: float) -> None:
        self.stats[self.index, 0] = handled
        self.stats[self.index, 1] = busy_s
