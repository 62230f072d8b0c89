"""The fused C kernels (cpu_elementwise.c; the norm and rotary in bf16 and float32) against the torch ops they
replace (the CPU backend's ops with its elementwise kernels off)."""

import pytest
import torch

import aioengine.gpu.layers as layers
from aioengine.config import KernelConfig
from aioengine.gpu.cpu.backend import CpuOps
from aioengine.kernels.cpu import clib as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here")


def _both(fn, *modules):
    """fn(ops) with the C kernels, then with the torch ops (each a fresh op set: no lookup is shared); the
    ``modules`` are switched to that op set first."""
    results = []
    for ops in (CpuOps(), CpuOps(KernelConfig(cpu_elementwise=False))):
        for module in modules:
            module.ops = ops
        results.append(fn(ops))
    return tuple(results)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("hidden", [64, 100, 576, 2048])
def test_add_rms_norm_matches_the_torch_ops(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = layers.RMSNorm(hidden, 1e-5, torch.bfloat16)
    norm.weight.data = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(rows, 2 * hidden, generator=gen).to(torch.bfloat16)[:, :hidden]  # strided rows
    (out_c, res_c), (out_t, res_t) = _both(lambda ops: norm(x, residual), norm)
    assert torch.equal(res_c, res_t)  # the residual add rounds once either way
    # The mean of squares is summed in another order: a normalized value may move by one bf16 ulp, which
    # the weight's product can round to two.
    assert _ulps_apart(out_c, out_t).max() <= 2
    assert (out_c == out_t).float().mean() > 0.99
    alone_c, alone_t = _both(lambda ops: norm(x), norm)
    assert _ulps_apart(alone_c, alone_t).max() <= 2


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 100, 640])
def test_gemma_norm_matches_the_torch_ops(rows, hidden):
    """Gemma's (1 + w) norm in one float32 product, rounded once: with a residual add, alone, and per head
    over a strided [tokens, heads, head_dim] view (its q/k norms on the qkv projection's output)."""
    from aioengine.gpu.models.gemma3 import GemmaRMSNorm

    gen = torch.Generator().manual_seed(rows * hidden + 2)
    norm = GemmaRMSNorm(hidden, 1e-6, torch.bfloat16, "cpu", CpuOps())
    norm.weight.data = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(rows, 2 * hidden, generator=gen).to(torch.bfloat16)[:, :hidden]  # strided rows
    (out_c, res_c), (out_t, res_t) = _both(lambda ops: norm(x, residual), norm)
    assert torch.equal(res_c, res_t)
    # the mean of squares summed in another order: one ulp at most, one rounding after it
    assert _ulps_apart(out_c, out_t).max() <= 1
    assert (out_c == out_t).float().mean() > 0.99
    alone_c, alone_t = _both(lambda ops: norm(x), norm)
    assert _ulps_apart(alone_c, alone_t).max() <= 1
    head = GemmaRMSNorm(64, 1e-6, torch.bfloat16, "cpu", CpuOps())
    head.weight.data = torch.randn(64, generator=gen).to(torch.bfloat16)
    qkv = (3 * torch.randn(rows, 7 * 64, generator=gen)).to(torch.bfloat16)
    q = qkv[:, : 4 * 64].view(rows, 4, 64)
    heads_c, heads_t = _both(lambda ops: head(q), head)
    assert heads_c.shape == q.shape and _ulps_apart(heads_c, heads_t).max() <= 1
    assert (heads_c == heads_t).float().mean() > 0.99


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("head_dim", [8, 24, 32, 64, 80, 128])
def test_rotary_matches_the_torch_ops_bit_for_bit(tokens, head_dim):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rope = layers.RotaryEmbedding(head_dim, 4096, 10000.0, dtype=torch.bfloat16)
    qkv = (4 * torch.randn(tokens, 7 * head_dim, generator=gen)).to(torch.bfloat16)
    qk = qkv[:, : 5 * head_dim].view(tokens, 5, head_dim)  # q and k heads of a fused projection
    positions = torch.randint(0, 4096, (tokens,), generator=gen)

    def rotate(ops):
        return ops.rotate(positions, qk, rope.cos_sin_cache)

    fused, reference = _both(rotate)
    assert fused.is_contiguous() and torch.equal(fused, reference)


def test_only_the_norm_and_rotary_take_float32():
    assert not cpu_kernels.elementwise_ok(torch.zeros(2, 4))  # the argmax's check: bf16 only
    assert cpu_kernels.elementwise_ok(torch.zeros(2, 4), (torch.bfloat16, torch.float32))
    assert cpu_kernels.elementwise_ok(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not cpu_kernels.elementwise_ok(torch.zeros(4, 2, dtype=torch.bfloat16).t())


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [64, 100, 576])
def test_float32_add_rms_norm_matches_the_torch_ops(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden + 1)
    norm = layers.RMSNorm(hidden, 1e-5, torch.float32)
    norm.weight.data = torch.randn(hidden, generator=gen)
    x = 3 * torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, 2 * hidden, generator=gen)[:, :hidden]  # strided rows
    (out_c, res_c), (out_t, res_t) = _both(lambda ops: norm(x, residual), norm)
    assert torch.equal(res_c, res_t)
    torch.testing.assert_close(out_c, out_t, rtol=2e-6, atol=2e-6)  # the sum of squares in another order
    alone_c, alone_t = _both(lambda ops: norm(x), norm)
    torch.testing.assert_close(alone_c, alone_t, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("head_dim", [8, 24, 64, 80])
def test_float32_rotary_matches_the_torch_ops(tokens, head_dim):
    gen = torch.Generator().manual_seed(tokens + head_dim + 1)
    rope = layers.RotaryEmbedding(head_dim, 4096, 10000.0, dtype=torch.float32)
    qkv = 4 * torch.randn(tokens, 7 * head_dim, generator=gen)
    qk = qkv[:, : 5 * head_dim].view(tokens, 5, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    fused, reference = _both(lambda ops: ops.rotate(positions, qk, rope.cos_sin_cache))
    assert fused.is_contiguous()
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-5)  # one fused multiply-add each


@pytest.mark.parametrize("cols", [1, 31, 32, 1000, 49157])
def test_argmax_matches_torch_with_ties_nans_and_signed_zeros(cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randint(-3, 4, (9, cols), generator=gen).float()  # many ties: the first index must win
    x[1] = -x[1].abs() - 1
    x[1, cols // 2] = -0.5  # largest in an all-negative row
    x[2] = -0.0
    x[2, cols - 1] = 0.0  # -0 and +0 tie: the first
    x[3, cols // 3] = float("nan")  # torch's argmax returns the first NaN
    x[4] = float("-inf")
    x[5] = float("nan")
    x[6, -1] = 100.0  # the tail past the last full vector
    bf = x.bfloat16()
    assert torch.equal(cpu_kernels.argmax(bf), bf.float().argmax(-1))
    strided = torch.zeros(9, cols + 7, dtype=torch.bfloat16)[:, :cols]
    strided.copy_(bf)
    assert torch.equal(cpu_kernels.argmax(strided), bf.float().argmax(-1))


def test_subnormals_and_nans_round_as_torch_rounds():
    """The AVX-512 loops round with vcvtneps2bf16, which flushes subnormals; a vector holding one (or a NaN)
    must take the exact path, so the bits stay torch's."""
    gen = torch.Generator().manual_seed(1)
    head_dim, tokens = 64, 3
    rope = layers.RotaryEmbedding(head_dim, 64, 10000.0, dtype=torch.bfloat16)
    qkv = torch.randn(tokens, 3 * head_dim, generator=gen)
    qkv[0, :16] = 3e-39  # subnormal in bf16 too: the products and sums stay subnormal
    qkv[1, 5] = float("nan")
    qkv = qkv.to(torch.bfloat16)
    qk = qkv[:, : 2 * head_dim].view(tokens, 2, head_dim)
    positions = torch.tensor([0, 3, 7])

    def rotate(ops):
        return ops.rotate(positions, qk, rope.cos_sin_cache)

    fused, reference = _both(rotate)
    assert torch.equal(fused.view(torch.int16), reference.view(torch.int16))
    assert (fused[0, 0, :16].float().abs() > 0).any()  # not flushed to zero

    norm = layers.RMSNorm(100, 1e-5, torch.bfloat16)
    norm.weight.data = torch.full((100,), 1e-39).to(torch.bfloat16)  # every output subnormal
    x = torch.randn(4, 100, generator=gen).to(torch.bfloat16)
    out_c, out_t = _both(lambda ops: norm(x), norm)
    assert (out_t.float() != 0).any() and _ulps_apart(out_c, out_t).max() <= 2
