"""Exact block codes of a GGUF's weights, recovered from the converted checkpoint's float32 copy.

GGUF's symmetric block types dequantize to ``code * scale``: one scale per 32 inputs for Q8_0, Q5_0 and Q4_0
(codes up to 127, 16 and 8), one per 16 for Q6_K (codes up to 32). Both factors are small enough that the
product is exact in float32, and the converted cache holds those products, so the codes and scales come back
bit for bit: a block's scale is its largest ``|w|`` over that largest code. Q4_1 (``affine=True``)
dequantizes to ``code * d + m`` with codes in [0, 15] and float16 d and m per 32: m is the block's smallest
weight (llama.cpp gives the smallest code 0) and d the float16 next to its span over 15. Each candidate is
verified on the whole block. Q4_K dequantizes to ``code * (d * sc) - dmin * m`` per 32 (float16 d and dmin
per 256, 6-bit sc and m), any 6-bit scales a quantizer chose: a sub-block's d * sc is its span over the
levels its smallest gap counts (or a float32 next to it), and its offset its smallest weight (code 0), or 0
where all are above 0. It runs as Q4_1 does, with float32 scales and offsets. A weight that is not such a
dequantization (float16 checkpoints, Q5_K, rows not a multiple of 64) gets None, and keeps its GEMM.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open

from aioengine.model.checkpoint import safetensors_files

# (block size, the largest codes to try, most likely first): Q8_0, Q5_0, Q4_0; then Q6_K, whose blocks'
# largest code varies (its sub-block scales are rounded to int8 before the codes are chosen).
SYMMETRIC_32 = (32, (127, 16, 8))
SYMMETRIC_16 = (16, tuple(range(32, 0, -1)))
KINDS = (SYMMETRIC_32, SYMMETRIC_16)
_CHUNK_ROWS = 2048  # a chunk's temporaries stay in cache
_PROBE_ROWS = 8  # the first chunk: a weight not of this kind fails there (hundreds of blocks), at little cost

Read = Callable[[int, int], torch.Tensor]  # rows r0..r1 of the weight


@dataclass(slots=True)
class BlockCodes:
    codes: torch.Tensor  # int8 [N, K]; with mins, uint8 in [0, 15]
    scales: torch.Tensor  # float32 [N, K / block]
    block: int
    mins: torch.Tensor | None = None  # float32 [N, K / 32]: the weight is codes * scales + mins


def block_codes(
    read: Read,
    n: int,
    k: int,
    kinds: Iterable[tuple[int, tuple[int, ...]]] = KINDS,
    affine: bool = False,
) -> BlockCodes | None:
    """The codes of the ``[n, k]`` float32 weight whose rows ``read(r0, r1)`` gives, for the first of
    ``kinds`` (then Q4_1's and Q4_K's, with ``affine``) that reproduces every block exactly; None for none."""
    if k % 64:
        return None
    for block, largest in kinds:
        found = _search(read, n, k, block, largest)
        if found is not None:
            return found
    return _affine_search(read, n, k) if affine else None


def _chunks(read: Read, n: int, k: int, block: int) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """(r0, r1, rows r0..r1 as blocks [r1 - r0, k / block, block]): the probe rows first, then chunks; the
    blocks are None for a weight that is not float32."""
    for r0 in [0, *range(_PROBE_ROWS, n, _CHUNK_ROWS)]:
        r1 = min(n, _PROBE_ROWS if r0 == 0 else r0 + _CHUNK_ROWS)
        w = read(r0, r1)
        yield r0, r1, (w.reshape(r1 - r0, k // block, block) if w.dtype == torch.float32 else None)


def _search(read: Read, n: int, k: int, block: int, largest: tuple[int, ...]) -> BlockCodes | None:
    codes = torch.empty((n, k), dtype=torch.int8)
    scales = torch.empty((n, k // block), dtype=torch.float32)
    for r0, r1, blocks in _chunks(read, n, k, block):
        if blocks is None:
            return None
        amax = blocks.abs().amax(-1)
        scale = torch.zeros_like(amax)
        q = torch.zeros_like(blocks)
        todo = amax > 0  # NaN (and all-zero) blocks stay at scale 0, code 0: the check below fails NaN
        for top in largest:
            if not todo.any():
                break
            # amax = top * d exactly, so amax / top is d: the quotient is representable
            s = amax / top
            guess = (blocks / s[..., None]).round_()
            ok = todo & (guess * s[..., None] == blocks).all(-1)
            scale = torch.where(ok, s, scale)
            q = torch.where(ok[..., None], guess, q)
            todo &= ~ok
        if todo.any() or not torch.equal(q * scale[..., None], blocks):  # NaN and inf fail here too
            return None
        codes[r0:r1], scales[r0:r1] = q.to(torch.int8).reshape(r1 - r0, k), scale
    return BlockCodes(codes, scales, block)


_NEIGHBOURS = (0, -1, 1, -2, 2)  # steps (float16's or float32's) around an estimate: a rounding may sit there
Candidates = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (d, offset) per block, most likely first


def _affine_candidates(blocks: torch.Tensor, low: torch.Tensor, high: torch.Tensor, top: int) -> Candidates:
    """Q4_1's: the float16 d around the span over 15, the offset the smallest weight (llama.cpp gives it
    code 0). Then Q4_K's (measured only if those fail): d * sc is a float32, the span over the levels the
    smallest gap counts (codes may skip a level) or a neighbour; the offset -dmin * m <= 0, so the smallest
    weight, or 0 for a block above 0 (a min clamped to 0)."""
    bits = ((high - low) / top).half().view(torch.int16)
    for near in _NEIGHBOURS:
        yield (bits + near).view(torch.float16).float(), low
    span = high - low
    gaps = blocks.sort(-1).values.diff(dim=-1)
    gap = torch.where(gaps > 0, gaps, torch.inf).amin(-1)
    step = torch.where(span > 0, span / (span / gap).round_().clamp_(1, top), 0.0)
    for near in _NEIGHBOURS:
        d = (step.view(torch.int32) + near).view(torch.float32)
        yield d, low.clamp(max=0.0)
        yield d, low


def _affine_search(read: Read, n: int, k: int, block: int = 32, top: int = 15) -> BlockCodes | None:
    codes = torch.empty((n, k), dtype=torch.uint8)
    scales = torch.empty((n, k // block), dtype=torch.float32)
    mins = torch.empty_like(scales)
    for r0, r1, blocks in _chunks(read, n, k, block):
        if blocks is None or not blocks.isfinite().all():
            return None
        low, high = blocks.amin(-1), blocks.amax(-1)
        done = high == low  # a flat block: code 0, d 0, its value the offset
        scale = torch.zeros_like(low)
        offset = low.clone()
        q = torch.zeros_like(blocks)
        for d, off in _affine_candidates(blocks, low, high, top):
            guess = ((blocks - off[..., None]) / d[..., None]).round_().clamp_(0, top)
            # each block checked whole, in the dequantizer's roundings: fl(code * d + offset) == w
            ok = ~done & (d > 0) & (guess * d[..., None]).add_(off[..., None]).eq_(blocks).all(-1)
            scale = torch.where(ok, d, scale)
            offset = torch.where(ok, off, offset)
            q = torch.where(ok[..., None], guess, q)
            done |= ok
            if done.all():
                break
        if not done.all():
            return None
        codes[r0:r1], scales[r0:r1], mins[r0:r1] = q.to(torch.uint8).reshape(r1 - r0, k), scale, offset
    return BlockCodes(codes, scales, block, mins)


@contextmanager
def float32_matrices(checkpoint: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The checkpoint's float32 2-D tensors by name, as safetensors slices (read a range of rows at a time),
    its files open for the context; empty when it has none (a bf16 or float16 checkpoint), or no files."""
    try:
        files = safetensors_files(checkpoint)
    except FileNotFoundError:
        files = []
    with ExitStack() as stack:
        found: dict[str, Any] = {}
        for file in files:  # each file's header parsed once, however many tensors are asked for
            f = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                part = f.get_slice(name)
                if part.get_dtype() == "F32" and len(part.get_shape()) == 2:
                    found[name] = part
        yield found


def read_block_codes(
    matrices: dict[str, Any],
    names: list[str],
    kinds: Iterable[tuple[int, tuple[int, ...]]] = KINDS,
    affine: bool = False,
) -> BlockCodes | None:
    """The codes of the tensors ``names`` (of ``float32_matrices``) stacked by rows (a fused weight's shards,
    in order), all of one kind and block size; None when one is missing or has no exact codes."""
    kinds = tuple(kinds)
    parts: list[BlockCodes] = []
    for name in names:
        part = matrices.get(name)
        if part is None:
            return None
        n, k = part.get_shape()

        def read(r0: int, r1: int, part: Any = part) -> torch.Tensor:
            return part[r0:r1]

        found = block_codes(read, n, k, kinds=kinds, affine=affine)
        if found is None or (parts and found.codes.shape[1:] != parts[0].codes.shape[1:]):
            return None
        if parts and (found.block != parts[0].block or (found.mins is None) != (parts[0].mins is None)):
            return None
        parts.append(found)
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return BlockCodes(
        torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), parts[0].block, mins
    )
