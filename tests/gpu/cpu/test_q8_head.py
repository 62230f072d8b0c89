"""The LM head on its checkpoint's own Q8_0 codes (gpu/cpu/q8_head.py): codes recovered exactly from a
float32 dequantization, refused for anything else, and the head's two paths by row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file
from torch import nn

from aioengine.gpu.cpu.codes_cache import checkpoint_codes
from aioengine.gpu.cpu.q8_head import Q8Head, q8_0_codes, read_head_codes
from aioengine.kernels.cpu import q8


def _q8_0(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw Q8_0 blocks [n, k / 32, 34], their float32 dequantization [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    return raw.reshape(n, k // 32, 34), dequantize(raw, GGMLQuantizationType.Q8_0).astype(np.float32)


def _weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return (codes.float().view(n, k // 32, 32) * scales[..., None]).view(n, k)


def test_codes_and_scales_are_the_files_own():
    raw, w = _q8_0(300, 128)
    found = q8_0_codes(torch.from_numpy(w))
    assert found is not None
    codes, scales = found
    want_scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    want_codes = raw[..., 2:].copy().view(np.int8).reshape(300, 128)
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scales.numpy(), want_scales)
    assert torch.equal(_weight(codes, scales), torch.from_numpy(w))


def test_anything_but_a_q8_0_dequantization_is_refused():
    _, w = _q8_0(64, 128)
    assert q8_0_codes(torch.randn(64, 128)) is None  # plain float32 weights
    assert q8_0_codes(torch.from_numpy(w).bfloat16()) is None  # not float32
    assert q8_0_codes(torch.from_numpy(w[:, :96].copy())) is None  # rows not a multiple of 64
    off = torch.from_numpy(w.copy())
    off[40, 70] = torch.nextafter(off[40, 70], torch.tensor(1.0))  # one value one ulp off
    assert q8_0_codes(off) is None
    off = torch.from_numpy(w.copy())
    off[3, 5] = float("nan")
    assert q8_0_codes(off) is None
    zeros = torch.from_numpy(w.copy())
    zeros[7] = 0.0  # all-zero blocks are Q8_0 too (scale 0)
    codes, scales = q8_0_codes(zeros)
    assert not codes[7].any() and not scales[7].any()


def test_read_head_codes_takes_lm_head_or_the_tied_embedding(tmp_path):
    _, w = _q8_0(128, 64)
    other = torch.randn(128, 64)
    tensors = {"lm_head.weight": torch.from_numpy(w), "model.embed_tokens.weight": other}
    save_file(tensors, tmp_path / "model.safetensors")
    with checkpoint_codes(tmp_path) as codes:
        assert torch.equal(_weight(*read_head_codes(codes, tied=False)), torch.from_numpy(w))
        assert read_head_codes(codes, tied=True) is None  # the embedding is not Q8_0
    with checkpoint_codes(tmp_path / "missing") as codes:
        assert read_head_codes(codes, tied=False) is None


@pytest.mark.skipif(not q8.available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
def test_head_runs_its_codes_for_few_rows_and_the_fallback_for_more():
    _, w = _q8_0(1000, 128)
    weight = torch.from_numpy(w)
    codes, scales = q8_0_codes(weight)
    fallback = nn.Linear(128, 1000, bias=False)
    fallback.weight.data.copy_(weight)
    head = Q8Head(codes, scales, limbs=2, fallback=fallback, max_rows=4)
    x = torch.randn(3, 128)
    got = head(x)
    exact = x.double() @ weight.double().t()
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-4)  # x cut to 16 bits per 4 inputs
    three = Q8Head(codes, scales, limbs=3)  # no fallback: the codes at every batch, x cut to 24 bits
    torch.testing.assert_close(three(x).double(), exact, rtol=0, atol=1e-6)
    assert torch.equal(three(torch.cat([x] * 4)), torch.cat([three(x)] * 4))
    assert three.argmax(torch.cat([x] * 4)).tolist() == three(x).argmax(-1).tolist() * 4
    assert not torch.equal(got, fallback(x))  # the codes' path, not the fallback's sums
    assert head.argmax(x).tolist() == got.argmax(-1).tolist()
    assert head(x.view(3, 1, 128)).shape == (3, 1, 1000)
    many = torch.randn(6, 128)
    assert torch.equal(head(many), fallback(many))
    assert head.argmax(many) is None  # nn.Linear cannot pick it itself: the sampler takes the logits
    assert head(x.bfloat16()).dtype == torch.float32  # bf16 hidden states, float32 logits


@pytest.mark.skipif(not q8.available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
def test_head_takes_the_fmas_on_its_codes_between_the_dots_and_the_gemm():
    """From ``fma_from`` rows the 8-bit FMAs run on x as it is (within float32's sums of the exact product,
    apart from the dots' bits); below it the dots; past ``max_rows`` the fallback. The greedy pick is the
    exact dots' (screened) up to ``screen_max`` rows; past it the sampler takes the FMAs' logits."""
    _, w = _q8_0(1000, 128, seed=1)
    weight = torch.from_numpy(w)
    codes, scales = q8_0_codes(weight)
    fallback = nn.Linear(128, 1000, bias=False)
    fallback.weight.data.copy_(weight)
    head = Q8Head(codes, scales, limbs=3, fallback=fallback, max_rows=16, fma_from=3, screen_max=4)
    dots = Q8Head(codes, scales, limbs=3)
    x = torch.randn(16, 128)
    exact = x.double() @ weight.double().t()
    for rows in (3, 5, 16):
        got = head(x[:rows])
        torch.testing.assert_close(got.double(), exact[:rows], rtol=0, atol=1e-5)
        assert torch.equal(got, q8.q8f_gemv(x[:rows], head.fma_packed, scales))
        picked = head.argmax(x[:rows])
        assert picked is None if rows > 4 else picked.tolist() == dots(x[:rows]).argmax(-1).tolist()
    assert torch.equal(head(x[:2]), dots(x[:2]))  # below fma_from: the dots
    assert head.argmax(x[:2]).tolist() == dots(x[:2]).argmax(-1).tolist()
    assert not torch.equal(head(x[:3]), dots(x[:3]))  # x uncut: other bits than the dots'
    assert torch.equal(head(torch.randn(17, 128).mul_(0).add_(x[:1])), fallback(x[:1].expand(17, -1)))
