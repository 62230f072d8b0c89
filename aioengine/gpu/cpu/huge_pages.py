"""Host tensors on transparent huge pages, for the weights the CPU's GEMMs stream every step.

A decode step reads every packed weight once. On 4 KiB pages that is a TLB miss every 4 KiB of weights,
each a page walk, and in a virtual machine a two-level one; 2 MiB pages take nearly all of them away.
Linux only backs memory with huge pages where asked (``transparent_hugepage/enabled`` is ``madvise`` on most
distributions), so the tensors come from anonymous mappings advised ``MADV_HUGEPAGE`` before their first
touch; elsewhere they are ordinary zeroed tensors.

Not the KV cache: left to fault in during a run, each huge page's first touch (zeroing, maybe compaction)
stalls a step; populated at allocation (MADV_POPULATE_WRITE), the engine's start waits while the kernel
compacts memory to find the cache's huge pages, for a small gain (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
_CHUNK = 64 << 20  # one mapping serves many tensors; its untouched tail costs no memory
_ALIGN = 64  # a cache line, as torch's CPU allocator aligns


class HugePageArena:
    """Carves tensors out of huge-page-advised mappings. A mapping lives as long as any tensor cut from it
    (each tensor holds a reference), so a model's weights free their memory with the model."""

    def __init__(self, chunk_bytes: int = _CHUNK) -> None:
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = (
            None  # uint8 view of the current mapping, from a huge-page boundary
        )
        self._used = 0

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` zeros, 64-byte aligned (memory is never reused, so it is fresh from the
        kernel), and a normal tensor even under inference mode."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return torch.zeros(numel, dtype=dtype)
        with self._lock, torch.inference_mode(False):
            if nbytes > self.chunk_bytes // 4:  # a large tensor gets a mapping of its own
                return _mapping(nbytes)[:nbytes].view(dtype)
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = _mapping(self.chunk_bytes), 0
            start = self._used
            self._used = -(-(start + nbytes) // _ALIGN) * _ALIGN
            return self._chunk[start : start + nbytes].view(dtype)


def _mapping(nbytes: int) -> torch.Tensor:
    """A fresh anonymous mapping advised MADV_HUGEPAGE, as uint8 from its first 2 MiB boundary (>= nbytes)."""
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a boundary
    buf = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP compiled out or disabled: ordinary pages
        buf.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # keeps ``buf`` alive while any view of it lives
    offset = -whole.data_ptr() % HUGE_PAGE
    return whole[offset : offset + length - HUGE_PAGE]


_arena = HugePageArena()


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``HugePageArena.zeros`` from the process's arena."""
    return _arena.zeros(numel, dtype)
