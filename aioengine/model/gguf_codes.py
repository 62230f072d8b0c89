"""A GGUF's stacked expert tensors as block codes, unpacked straight from the file's blocks, never as float32.

A mixture's experts are most of its bytes (a 30B-A3B model's are ~29B of its 30B weights), so the converter
keeps them in the file's own precision: each block type below is ``code * scale`` per block (symmetric: Q8_0,
Q5_0, Q4_0 per 32, Q6_K per 16) or ``code * scale + min`` per 32 (affine 4-bit: Q4_1, Q4_K), with float32
scales and mins that are exact products of the file's float16 factors and small integers. So
``codes * scales (+ mins)`` in float32 is bit for bit what the gguf package's dequantizer returns (the
test checks each type). Other types (Q5_K, Q2_K, Q3_K, IQ*, MXFP4) have no such form here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

# GGML type id -> (name, block size, bytes per block); the types unpacked here
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
LAYOUTS = {
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22),
    Q8_0: ("Q8_0", 32, 34),
    Q4_K: ("Q4_K", 256, 144),
    Q6_K: ("Q6_K", 256, 210),
}
AFFINE = frozenset({Q4_1, Q4_K})  # 4-bit codes in [0, 15] with a min per 32; the rest int8, symmetric
MIN_COLUMNS = 64  # the CPU kernels take inputs in runs of 64


@dataclass(slots=True)
class Codes:
    """``[..., N, K]`` weights as codes: symmetric int8 ``codes * scales`` per ``block`` inputs, or affine
    uint8 4-bit ``codes * scales + mins`` per 32 (``mins`` float32 like ``scales``: ``[..., N, K / 32]``)."""

    codes: np.ndarray
    scales: np.ndarray
    block: int
    mins: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """The float32 weights, in the dequantizer's roundings (one product, then one sum)."""
        *lead, k = self.codes.shape
        w = self.codes.reshape(*lead, k // self.block, self.block).astype(np.float32)
        w = w * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(*lead, k)


def codes_type(type_id: int, columns: int) -> bool:
    """Whether a tensor of GGML type ``type_id`` with rows of ``columns`` inputs unpacks to codes here."""
    return type_id in LAYOUTS and columns % MIN_COLUMNS == 0


def kind(type_id: int) -> tuple[int, bool]:
    """(block size of the scales, affine) of a type's codes: tensors stacked together must agree."""
    return (16 if type_id == Q6_K else 32), type_id in AFFINE


def unpack(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> Codes:
    """The file's bytes ``raw`` of a tensor of ``shape`` (torch order) and type ``type_id`` as ``Codes``."""
    _, size, nbytes = LAYOUTS[type_id]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    n = blocks.shape[0]

    def f16(col: int) -> np.ndarray:  # a float16 factor at byte ``col`` of each block, as float32 [n, 1]
        return blocks[:, col : col + 2].copy().view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] bytes -> [n, 32]: low nibbles first, then high
        return np.concatenate([qs & 15, qs >> 4], axis=-1)

    mins = None
    if type_id == Q8_0:
        codes, scales = blocks[:, 2:].view(np.int8), f16(0)
    elif type_id == Q4_0:
        codes, scales = nibbles(blocks[:, 2:]).astype(np.int8) - 8, f16(0)
    elif type_id == Q4_1:
        codes, scales, mins = nibbles(blocks[:, 4:]), f16(0), f16(2)
    elif type_id == Q5_0:
        high = blocks[:, 2:6].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
        codes = (nibbles(blocks[:, 6:]) | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - 16
        scales = f16(0)
    elif type_id == Q4_K:
        # 8 sub-blocks of 32: 6-bit scales and mins packed in 12 bytes, codes as 4 runs of 32 bytes whose
        # low nibbles are one sub-block and high nibbles the next
        packed = blocks[:, 4:16].reshape(n, 3, 4)
        lo, hi, both = packed[:, 0], packed[:, 1], packed[:, 2]
        sc = np.concatenate([lo & 63, (both & 15) | ((lo >> 2) & 48)], axis=-1).astype(np.float32)
        mn = np.concatenate([hi & 63, (both >> 4) | ((hi >> 2) & 48)], axis=-1).astype(np.float32)
        qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 15).reshape(n, 256)
        scales, mins = f16(0) * sc, -(f16(2) * mn)
    elif type_id == Q6_K:
        # 16 sub-blocks of 16: low 4 bits in 128 bytes, high 2 bits in 64, int8 scales, then d
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 4, 1
        )
        q = (ql & 15).reshape(n, 8, 32) | ((qh & 3).reshape(n, 8, 32) << 4)
        codes = q.reshape(n, 256).astype(np.int8) - 32
        scales = f16(208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    else:
        raise ValueError(f"GGML type {type_id} has no block codes here")
    block, _ = kind(type_id)
    k = shape[-1]
    lead = shape[:-1]
    assert n * size == int(np.prod(shape)), (n, size, shape)
    return Codes(
        np.ascontiguousarray(codes).reshape(*lead, k),
        np.ascontiguousarray(scales, dtype=np.float32).reshape(*lead, k // block),
        block,
        None if mins is None else np.ascontiguousarray(mins, dtype=np.float32).reshape(*lead, k // 32),
    )


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes ``[..., K]`` two to a byte (even inputs in the low nibble), as they are stored."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """``pack_nibbles`` undone."""
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


# A layer's experts as block codes in a converted checkpoint: "<layer>.mlp.experts.<proj>.<part>"
EXPERT_CODES = re.compile(
    r"^(?P<layer>.*\.layers\.\d+)\.mlp\.experts\.(?P<proj>gate_up|down)\.(?P<part>codes|scales|mins)$"
)
