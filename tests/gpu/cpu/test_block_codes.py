"""gpu/cpu/block_codes.py: a GGUF's symmetric block types come back from their float32 dequantization as the
file's own codes and scales, bit for bit; every other weight is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from aioengine.gpu.cpu.block_codes import block_codes, float32_matrices, read_block_codes


def _weight(found) -> torch.Tensor:
    n, k = found.codes.shape
    return (found.codes.float().view(n, -1, found.block) * found.scales[..., None]).view(n, k)


def _dequantized(qtype: Q, n: int, k: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q8_0, Q.Q5_0, Q.Q4_0, Q.Q4_1):
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    else:  # K-quants: the package cannot quantize them; random blocks with a sane float16 super-scale
        block, nbytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
        at = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}[qtype]
        for a in at:
            raw[..., a : a + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
        raw = raw.reshape(n, -1)
    return torch.from_numpy(dequantize(raw, qtype).astype(np.float32).reshape(n, k))


def _codes(w: torch.Tensor):
    return block_codes(lambda r0, r1: w[r0:r1], *w.shape)


# Q4_0's codes may come back doubled, with half the scale (its largest code over 16 is as exact as over 8)
@pytest.mark.parametrize(
    ("qtype", "block", "largest"), [(Q.Q8_0, 32, 127), (Q.Q5_0, 32, 16), (Q.Q4_0, 32, 16)]
)
def test_symmetric_32_blocks_are_the_files_codes(qtype, block, largest):
    w = _dequantized(qtype, 96, 256)
    found = _codes(w)
    assert found is not None and found.block == block
    assert torch.equal(_weight(found), w)
    assert int(found.codes.abs().max()) == largest
    if qtype == Q.Q8_0:  # the scales are the file's float16 ones
        raw = quantize(np.random.default_rng(0).standard_normal((96, 256)).astype(np.float32) * 0.05, qtype)
        want = raw.reshape(96, 8, 34)[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        assert np.array_equal(found.scales.numpy(), want)


def test_q6_k_comes_back_in_blocks_of_16():
    w = _dequantized(Q.Q6_K, 64, 512)
    found = _codes(w)
    assert found is not None and found.block == 16
    assert torch.equal(_weight(found), w)
    assert int(found.codes.abs().max()) <= 32


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q4_1])
def test_blocks_with_offsets_are_refused(qtype):
    assert _codes(_dequantized(qtype, 64, 256)) is None


def test_anything_but_an_exact_dequantization_is_refused():
    w = _dequantized(Q.Q5_0, 100, 128)
    assert _codes(torch.randn(100, 128)) is None
    assert _codes(w[:, :96].contiguous()) is None  # rows not a multiple of 64
    assert block_codes(lambda r0, r1: w[r0:r1].bfloat16(), *w.shape) is None
    for row in (3, 90):  # in the first (probe) chunk and past it
        off = w.clone()
        off[row, 70] = torch.nextafter(off[row, 70], torch.tensor(1.0))
        assert _codes(off) is None
    off = w.clone()
    off[80, 5] = float("nan")
    assert _codes(off) is None
    off = w.clone()
    off[81, 5] = float("inf")
    assert _codes(off) is None
    zero = w.clone()
    zero[7] = 0.0  # all-zero blocks are fine (scale 0)
    found = _codes(zero)
    assert found is not None and not found.codes[7].any() and not found.scales[7].any()


def test_read_block_codes_stacks_a_fused_weights_shards(tmp_path):
    q, k, v = (_dequantized(t, n, 128, s) for t, n, s in ((Q.Q5_0, 64, 1), (Q.Q5_0, 32, 2), (Q.Q8_0, 32, 3)))
    tensors = {
        "l.q_proj.weight": q,
        "l.k_proj.weight": k,
        "l.v_proj.weight": v,
        "l.down_proj.weight": _dequantized(Q.Q6_K, 128, 256),
        "l.up_proj.weight": torch.randn(64, 128),
        "l.gate_proj.weight": _dequantized(Q.Q5_0, 64, 256, 4),
        "l.f16.weight": q.half(),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    with float32_matrices(tmp_path) as matrices:
        assert "l.f16.weight" not in matrices  # only float32 matrices are offered
        found = read_block_codes(matrices, ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight"])
        assert found is not None and found.block == 32
        assert torch.equal(_weight(found), torch.cat([q, k, v]))
        assert read_block_codes(matrices, ["l.q_proj.weight", "l.up_proj.weight"]) is None  # a plain shard
        assert read_block_codes(matrices, ["l.q_proj.weight", "l.missing.weight"]) is None
        assert read_block_codes(matrices, ["l.f16.weight"]) is None
        assert read_block_codes(matrices, ["l.down_proj.weight"]).block == 16
        assert read_block_codes(matrices, ["l.gate_proj.weight", "l.down_proj.weight"]) is None  # 32 and 16
    with float32_matrices(tmp_path / "nowhere") as matrices:
        assert matrices == {}


def _affine_weight(found) -> torch.Tensor:
    """codes * d + m in float32's roundings, as the gguf package dequantizes Q4_1."""
    n, k = found.codes.shape
    blocks = found.codes.float().view(n, -1, 32) * found.scales[..., None] + found.mins[..., None]
    return blocks.view(n, k)


def test_q4_1_comes_back_as_its_files_4_bit_codes_scales_and_offsets():
    rng = np.random.default_rng(5)
    raw = quantize(rng.standard_normal((96, 320)).astype(np.float32) * 0.05, Q.Q4_1)
    w = torch.from_numpy(dequantize(raw, Q.Q4_1).astype(np.float32).reshape(96, 320))
    w[3, :32] = 0.25  # a flat block: code 0 and its offset
    assert _codes(w) is None  # offsets only where asked for
    found = block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True)
    assert found is not None and found.block == 32 and found.codes.dtype == torch.uint8
    assert int(found.codes.max()) == 15 and torch.equal(_affine_weight(found), w)
    blocks = raw.reshape(96, 10, 20)  # float16 d, float16 m, 16 bytes of codes
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    d[3, 0], m[3, 0] = 0.0, 0.25
    assert np.array_equal(found.scales.numpy(), d) and np.array_equal(found.mins.numpy(), m)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_k_quants_offsets_are_refused_even_with_affine(qtype):
    w = _dequantized(qtype, 64, 256)
    assert block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True) is None


def test_anything_but_an_exact_q4_1_dequantization_is_refused():
    w = _dequantized(Q.Q4_1, 100, 128)
    assert block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True) is not None
    for row in (3, 90):
        off = w.clone()
        off[row, 70] = torch.nextafter(off[row, 70], torch.tensor(1.0))
        assert block_codes(lambda r0, r1, off=off: off[r0:r1], *w.shape, affine=True) is None
    for bad in (float("nan"), float("inf")):
        off = w.clone()
        off[80, 5] = bad
        assert block_codes(lambda r0, r1, off=off: off[r0:r1], *w.shape, affine=True) is None
    assert block_codes(lambda r0, r1: torch.randn(r1 - r0, 128), *w.shape, affine=True) is None


def test_read_block_codes_stacks_q4_1_shards_with_their_offsets(tmp_path):
    gate, up = _dequantized(Q.Q4_1, 64, 128, 1), _dequantized(Q.Q4_1, 64, 128, 2)
    save_file(
        {"l.gate_proj.weight": gate, "l.up_proj.weight": up, "l.q8.weight": _dequantized(Q.Q8_0, 64, 128, 3)},
        tmp_path / "model.safetensors",
    )
    with float32_matrices(tmp_path) as matrices:
        found = read_block_codes(matrices, ["l.gate_proj.weight", "l.up_proj.weight"], affine=True)
        assert found is not None and found.mins is not None and found.mins.shape == (128, 4)
        assert torch.equal(_affine_weight(found), torch.cat([gate, up]))
        assert read_block_codes(matrices, ["l.gate_proj.weight", "l.up_proj.weight"]) is None
        assert read_block_codes(matrices, ["l.gate_proj.weight", "l.q8.weight"], affine=True) is None
