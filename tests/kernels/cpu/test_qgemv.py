"""cpu_qgemv.c (int8 weights, float32 activations, a few rows) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from aioengine.kernels.cpu import clib

pytestmark = pytest.mark.skipif(clib.load() is None, reason="the C kernels cannot be built here")


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (33, 40), (7, 100), (257, 576)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_qgemv_equals_the_dequantized_matmul(rows, n, k, with_bias):
    """Odd output counts, inner sizes off the 16-wide vectors, more rows than one register block."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01 + 1e-3
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, k, generator=g)
    want = x.double() @ (q.double() * scale.double()[:, None]).t()
    if bias is not None:
        want += bias.double()
    got = clib.qgemv_int8(x, q, scale, bias)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_qgemv_reads_strided_rows():
    q = torch.randint(-127, 128, (20, 32), dtype=torch.int8)
    scale = torch.full((20,), 0.01)
    wide = torch.randn(3, 48)
    x = wide[:, :32]  # row stride 48
    torch.testing.assert_close(clib.qgemv_int8(x, q, scale, None), x @ (q.float() * 0.01).t())


def _q8_0_case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4
    # Blocks of very different sizes: each is cut to 16 bits against its own largest value.
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 2, k // 32).repeat_interleave(32)
    return x, q, scale


XQ_MAX = {2: 32639, 3: 8355711}


def _q8_0_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, limbs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 x W^T, and the bound the kernel's one rounding allows: |x - sx xq| <= sx / 2 per input, with
    sx = (the largest |x| of its 4 inputs) / XQ_MAX, plus float32's share of the sums."""
    n, k = q.shape
    w = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    xd = x.double()
    sx = xd.abs().view(len(x), -1, 4).amax(-1) / XQ_MAX[limbs]
    step = (sx / 2).repeat_interleave(4, dim=1)
    bound = step @ w.abs().t() + 1e-6 * (xd.abs() @ w.abs().t())
    return xd @ w.t(), bound


@pytest.mark.skipif(not clib.q8_0_available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (33, 576), (1001, 640)])
@pytest.mark.parametrize("limbs", [2, 3])
def test_q8_0_gemv_is_within_its_one_rounding_of_the_exact_weights(rows, n, k, limbs):
    """Odd output counts, more rows than one register block; the packed order of the codes and of x's bytes
    must agree, or the sums mix blocks with each other's scales."""
    x, q, scale = _q8_0_case(rows, n, k, rows * 7 + n + k)
    want, bound = _q8_0_reference(x, q, scale, limbs)
    got = clib.qgemv_q8_0(x, clib.q8_0_pack(q), scale, limbs=limbs).double()
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    # far below what rounding the same weights to bf16 (the GEMM's head) costs
    w = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bf16 = x.double() @ w.bfloat16().double().t()
    assert (got - want).abs().mean() < (bf16 - want).abs().mean() / 20


@pytest.mark.skipif(not clib.q8_0_available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
def test_q8_0_gemv_reads_strided_rows_and_ties_its_argmax_to_torchs():
    x, q, scale = _q8_0_case(5, 4099, 128, 3)
    q[4000] = q[17]  # equal maxima in different threads' ranges: the first wins
    scale[4000] = scale[17]
    x[2] = 0.0  # an all-zero row: every logit ties at 0, argmax 0
    u = clib.q8_0_pack(q)
    wide = torch.zeros(5, 160)
    wide[:, :128] = x
    logits = clib.qgemv_q8_0(wide[:, :128], u, scale)
    torch.testing.assert_close(logits, clib.qgemv_q8_0(x, u, scale), rtol=0, atol=0)
    logits[:, 17] = logits.max(-1).values + 1  # make 17 (and its twin 4000) the maxima to test the tie
    scale[17] *= 0
    scale[4000] *= 0
    x2 = x.clone()
    got = clib.qgemv_q8_0(x2, u, scale, argmax=True)
    assert got.tolist() == clib.qgemv_q8_0(x2, u, scale).argmax(-1).tolist()
    assert got[2] == 0


@pytest.mark.skipif(not clib.q8_0_available(), reason="qgemv_q8_0 is vectorized for AVX512-VNNI only")
def test_q8_0_argmax_takes_the_first_maximum_across_threads_and_the_first_nan():
    n, k = 6000, 64
    q = torch.zeros(n, k, dtype=torch.int8)
    q[:, 0] = 1
    scale = torch.full((n, 2), 0.5)
    x = torch.zeros(2, k)
    x[:, 0] = 1.0
    scale[[10, 5000], 0] = 2.0  # the largest logit twice, one in each half
    assert clib.qgemv_q8_0(x, clib.q8_0_pack(q), scale, argmax=True).tolist() == [10, 10]
    scale[[4000, 5500], 1] = float("nan")  # NaN logits win, the first of them
    got = clib.qgemv_q8_0(x, clib.q8_0_pack(q), scale, argmax=True)
    assert got.tolist() == [4000, 4000]
    assert got.tolist() == clib.qgemv_q8_0(x, clib.q8_0_pack(q), scale).argmax(-1).tolist()
