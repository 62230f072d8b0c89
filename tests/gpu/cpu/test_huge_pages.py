"""Packed CPU weights on transparent huge pages (gpu/huge_pages.py): placement, advice and lifetime."""

from __future__ import annotations

import ctypes
import gc
import mmap
import pathlib

import pytest
import torch

from aioengine.gpu.cpu import huge_pages
from aioengine.gpu.cpu.huge_pages import HugePageArena
from aioengine.gpu.cpu.linear import PackedLinear, c_gemm_enabled, packing_enabled

_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(
    not _THP.exists() or "[never]" in _THP.read_text(), reason="no transparent huge pages on this kernel"
)


def _vma_flags(addr: int) -> list[str] | None:
    """The VmFlags of the mapping holding ``addr`` in /proc/self/smaps; None if no mapping holds it."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return None


def test_tensors_are_aligned_disjoint_and_writable():
    arena = HugePageArena(chunk_bytes=1 << 20)
    tensors = [
        arena.zeros(n, dtype)
        for n, dtype in [
            (3, torch.bfloat16),
            (1000, torch.float32),
            (7, torch.int64),
            (200_000, torch.bfloat16),
            (50_000, torch.bfloat16),
        ]
    ]  # the 400 KB one gets its own mapping; the last opens a new chunk
    spans = []
    for i, t in enumerate(tensors):
        assert t.is_contiguous() and t.dim() == 1 and t.data_ptr() % 64 == 0 and not t.any()
        t.fill_(i + 1)
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert [int(t[-1]) for t in tensors] == [1, 2, 3, 4, 5]
    assert tensors[1].numel() == 1000 and tensors[1].dtype == torch.float32


@needs_thp
def test_the_memory_is_advised_for_huge_pages_and_starts_on_a_boundary():
    arena = HugePageArena()
    big = arena.zeros(3 << 20, torch.bfloat16)  # 6 MiB: a mapping of its own
    small = arena.zeros(100, torch.bfloat16)
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in _vma_flags(big.data_ptr()) and "hg" in _vma_flags(small.data_ptr())
    # The control is a plain anonymous mapping: where malloc puts a torch tensor is glibc's choice, not ours.
    plain = mmap.mmap(-1, 6 << 20)
    first = ctypes.c_char.from_buffer(plain)
    try:
        assert "hg" not in (_vma_flags(ctypes.addressof(first)) or [])
    finally:
        del first
        plain.close()


@needs_thp
def test_a_mapping_lives_as_long_as_its_tensors():
    arena = HugePageArena()
    t = arena.zeros(3 << 20, torch.bfloat16)
    addr = t.data_ptr()
    del arena
    gc.collect()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * t.numel() and _vma_flags(addr) is not None
    del t
    gc.collect()
    assert _vma_flags(addr) is None  # unmapped with its last tensor: a model's weights free their memory


@needs_thp
@pytest.mark.skipif(
    not (packing_enabled(torch.empty(1, dtype=torch.bfloat16)) and c_gemm_enabled()),
    reason="cpu_gemm.c needs AVX512-BF16",
)
def test_packed_linear_weights_live_on_huge_pages_and_compute_the_same():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    layer = PackedLinear(weight, None)
    assert "hg" in _vma_flags(layer.packed.data_ptr())
    x = torch.randn(5, 64, generator=gen).bfloat16()
    torch.testing.assert_close(layer(x).float(), (x.float() @ weight.float().T), atol=0.05, rtol=0.02)


def test_without_madvise_the_tensors_are_ordinary_zeros(monkeypatch):
    import mmap

    monkeypatch.delattr(mmap, "MADV_HUGEPAGE", raising=False)  # not Linux, or Python built without it
    t = HugePageArena().zeros(1000, torch.bfloat16)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and not t.any()
    t.fill_(1.0)
    assert float(t.sum()) == 1000.0
