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
