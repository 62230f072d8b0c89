"""The KV offload tier's disk files: one checksummed file a block, written and read on one I/O thread.

The folder is named for the model and its KV layout, and neither the steps nor the event loop wait on
disk. A file holds a header (block hash, group, token count, payload size), the block's token ids, the block's
KV bytes (every cache tensor's slot, as the host tier lays them out) and a CRC-32 of all of it. A read
checks the size, the checksum and the token ids against the request's own tokens; any mismatch (a
truncated or corrupt file, a file of another block's tokens) deletes the file, and the tokens are computed
again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import os
import struct
import threading
import zlib
from pathlib import Path

logger = logging.getLogger("aioengine.kv_disk")

_MAGIC = b"AIOKV\x00\x01\x00"
_HEADER = struct.Struct("<8sQIIQ")  # magic, block hash (unsigned), group, token count, payload bytes
_CRC = struct.Struct("<I")
_SUFFIX = ".kv"
_U64 = (1 << 64) - 1


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


class KVDiskTier:
    """The block files of one model's KV layout, under ``root``; the index of what they hold is the
    scheduler's (sched/kv_offload.py), built from ``scan`` at start."""

    def __init__(self, root: str, fingerprint: str, block_bytes: int, max_pending_writes: int = 256) -> None:
        """``fingerprint``: what the KV bytes depend on (the model's files, dtype, block size, layout), so
        that a folder's blocks are only ever read back by a server that would have computed the same."""
        digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:20]
        self.dir = Path(root) / digest
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "fingerprint.txt").write_text(fingerprint + "\n")
        self.block_bytes = block_bytes
        self.max_pending_writes = max_pending_writes
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioengine-kv-disk")
        self._lock = threading.Lock()
        self._pending = 0
        self.written = 0
        self.writes_dropped = 0  # the I/O thread was too far behind (the host tier still holds them)
        self.writes_failed = 0

    def path(self, block_hash: int, group: int) -> Path:
        return self.dir / f"{block_hash & _U64:016x}-{group}{_SUFFIX}"

    def scan(self) -> list[tuple[int, int]]:
        """The keys of the block files already there, oldest first."""
        found = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(_SUFFIX):
                continue
            try:
                h, g = name[: -len(_SUFFIX)].split("-")
                found.append((entry.stat().st_mtime_ns, _signed(int(h, 16)), int(g)))
            except (ValueError, OSError):
                continue  # not one of ours, or gone meanwhile
        found.sort()
        return [(h, g) for _, h, g in found]

    # ---- writes: from the worker, behind the steps ---------------------------------------------------
    def write(self, block_hash: int, group: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        with self._lock:
            if self._pending >= self.max_pending_writes:
                self.writes_dropped += 1
                return
            self._pending += 1
        try:
            self._io.submit(self._write, block_hash, group, token_ids, payload)
        except RuntimeError:  # closed (the engine is stopping)
            with self._lock:
                self._pending -= 1
                self.writes_dropped += 1

    def _write(self, block_hash: int, group: int, token_ids: tuple[int, ...], payload: bytes) -> None:
        try:
            path = self.path(block_hash, group)
            header = _HEADER.pack(_MAGIC, block_hash & _U64, group, len(token_ids), len(payload))
            tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
            crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(header)))
            # a name of its own: other servers (replicas, a model's alias) may share the folder
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(tokens)
                f.write(payload)
                f.write(_CRC.pack(crc))
            os.replace(tmp, path)  # whole or absent: a reader never sees half a file under the name
            self.written += 1
        except OSError as e:
            self.writes_failed += 1
            logger.warning("KV disk tier: writing a block failed: %s", e)
        finally:
            with self._lock:
                self._pending -= 1

    def delete(self, block_hash: int, group: int) -> None:
        """A block file past the cap, removed behind the writes already queued."""
        with contextlib.suppress(RuntimeError):  # closed (the engine is stopping)
            self._io.submit(self.path(block_hash, group).unlink, missing_ok=True)

    def file_bytes(self, block_size: int) -> int:
        """A block file's size, for blocks of ``block_size`` tokens."""
        return _HEADER.size + 4 * block_size + self.block_bytes + _CRC.size

    # ---- reads: for the engine, off the loop --------------------------------------------------------
    def read(self, block_hash: int, group: int, token_ids: tuple[int, ...]) -> concurrent.futures.Future:
        """The block's KV bytes, or None when the file is missing or bad (then it is deleted)."""
        return self._io.submit(self._read, block_hash, group, token_ids)

    def _read(self, block_hash: int, group: int, token_ids: tuple[int, ...]) -> bytes | None:
        path = self.path(block_hash, group)
        try:
            data = path.read_bytes()
        except OSError as e:
            logger.warning("KV disk tier: cannot read %s (%s); its tokens are computed again", path.name, e)
            return None
        why = self._check(data, block_hash, group, token_ids)
        if why is None:
            start = _HEADER.size + 4 * len(token_ids)
            return data[start : start + self.block_bytes]
        logger.warning("KV disk tier: %s is %s; deleted, its tokens are computed again", path.name, why)
        path.unlink(missing_ok=True)
        return None

    def _check(self, data: bytes, block_hash: int, group: int, token_ids: tuple[int, ...]) -> str | None:
        """Why the file cannot be used, or None."""
        n = len(token_ids)
        if len(data) != self.file_bytes(n):
            return f"{len(data)} bytes long, not {self.file_bytes(n)}"
        (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
        if zlib.crc32(memoryview(data)[: -_CRC.size]) != crc:
            return "corrupt (checksum mismatch)"
        magic, h, g, count, size = _HEADER.unpack_from(data)
        if (magic, h, g, count, size) != (_MAGIC, block_hash & _U64, group, n, self.block_bytes):
            return "another block's (header mismatch)"
        if struct.unpack_from(f"<{n}I", data, _HEADER.size) != token_ids:
            return "another block's (its tokens differ)"
        return None

    def clear(self) -> None:
        """Delete every block file (the prefix cache's reset), behind the writes already queued."""

        def remove() -> None:
            for entry in os.scandir(self.dir):
                if entry.name.endswith(_SUFFIX):
                    Path(entry.path).unlink(missing_ok=True)

        self._io.submit(remove)

    def close(self) -> None:
        """Finish the queued writes (a restart finds them), then stop the I/O thread."""
        self._io.shutdown(wait=True)


def fingerprint(model_path: str, **settings: object) -> str:
    """What a block's KV bytes depend on: the model's files (names, sizes, modification times) and the
    settings given (dtype, block size, the cache's layout, the kernels)."""
    path = Path(model_path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    parts = [f"model={path.resolve()}"]
    for f in files:
        st = f.stat()
        parts.append(f"file={f.name}:{st.st_size}:{st.st_mtime_ns}")
    parts += [f"{k}={v}" for k, v in sorted(settings.items())]
    return "\n".join(parts)
