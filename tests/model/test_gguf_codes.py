"""The GGUF block types a mixture's experts keep as codes: unpacked straight from the file's bytes, their
``codes * scales (+ mins)`` equals the gguf package's dequantizer bit for bit, for every block type, with
random bytes in every field (the float16 factors set finite), and stacked ``[E, N, K]`` as experts are."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from aioengine.model import gguf_codes  # noqa: E402

# each type's float16 factors' byte offsets in its block
FACTORS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(int(np.prod(shape)) // block, nbytes), dtype=np.uint8)
    for at in FACTORS[qtype]:  # finite float16 factors of both signs and many exponents
        f = (rng.standard_normal(raw.shape[0]) * 2.0 ** rng.integers(-12, 4, raw.shape[0])).astype(np.float16)
        raw[:, at : at + 2] = f.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", sorted(FACTORS, key=int), ids=lambda q: q.name)
def test_codes_dequantize_to_the_gguf_packages_values_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (3, 8, 512)  # experts, rows, inputs
    raw = random_blocks(qtype, shape, rng)
    codes = gguf_codes.unpack(raw, int(qtype), shape)
    want = dequantize(raw.reshape(shape[0] * shape[1], -1), qtype).reshape(shape)
    got = codes.dequantize()
    assert got.dtype == np.float32 and got.shape == shape
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    block, affine = gguf_codes.kind(int(qtype))
    assert codes.block == block and (codes.mins is not None) == affine
    assert codes.scales.shape == (*shape[:2], shape[2] // block)
    if affine:
        assert codes.codes.dtype == np.uint8 and codes.codes.max() <= 15
        packed = gguf_codes.pack_nibbles(codes.codes)
        assert packed.shape == (*shape[:2], shape[2] // 2)
        np.testing.assert_array_equal(gguf_codes.unpack_nibbles(packed), codes.codes)
    else:
        assert codes.codes.dtype == np.int8


def test_types_without_codes_and_short_rows_are_not_taken():
    assert not gguf_codes.codes_type(int(Q.Q5_K), 256)
    assert not gguf_codes.codes_type(int(Q.MXFP4), 256)
    assert not gguf_codes.codes_type(int(Q.Q8_0), 32)  # the kernels run inputs in 64s
    assert gguf_codes.codes_type(int(Q.Q4_K), 256)
