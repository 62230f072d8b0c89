"""Triton RMSNorm (+ fused residual add), neox RoPE and SiluAndMul against their torch references
(``aioengine.kernels.reference``, what the layers run by default), interpreted on CPU without a GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

pytest.importorskip("triton")

from aioengine.gpu.backend import REFERENCE_OPS  # noqa: E402
from aioengine.gpu.cuda.backend import CudaOps  # noqa: E402
from aioengine.gpu.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from aioengine.kernels.reference import add_rms_norm as rms_norm_reference  # noqa: E402
from aioengine.kernels.reference import rotary as rotary_reference  # noqa: E402
from aioengine.kernels.reference import silu_and_mul  # noqa: E402
from aioengine.kernels.reference import silu_and_mul as silu_and_mul_reference  # noqa: E402
from aioengine.kernels.triton.activation import silu_and_mul_triton  # noqa: E402
from aioengine.kernels.triton.norm_rope import (  # noqa: E402
    _rms_norm_kernel,
    _rope_kernel,
    rms_norm_triton,
    rotary_triton,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OPS = CudaOps() if CUDA else REFERENCE_OPS  # what a layer on DEVICE runs: the kernels on a GPU


def test_interpreter_is_on_without_a_gpu():
    if not CUDA:
        assert type(_rms_norm_kernel).__name__ == "InterpretedFunction"
        assert type(_rope_kernel).__name__ == "InterpretedFunction"


def _randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("hidden", [24, 64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference_and_layer(hidden, with_residual):
    x = _randn(7, hidden, seed=1) * 3
    weight = _randn(hidden, seed=2)
    residual = _randn(7, hidden, seed=3) if with_residual else None
    out = rms_norm_triton(x, weight, 1e-6, residual)
    ref = rms_norm_reference(x, weight, 1e-6, residual)
    layer = RMSNorm(hidden, 1e-6, device=DEVICE, ops=OPS)
    layer.weight.data.copy_(weight)
    with torch.no_grad():
        from_layer = layer(x, residual)
    if with_residual:
        torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0], from_layer[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], ref[1]) and torch.equal(out[1], from_layer[1])
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, from_layer, atol=1e-5, rtol=1e-5)


def test_rms_norm_per_head_strided_view():
    """Qwen3's q_norm/k_norm: [T, H, D] views of a fused qkv, normalised over D."""
    qkv = _randn(5, 4 * 24 + 2 * 2 * 24, seed=4)
    q = qkv[:, : 4 * 24].view(5, 4, 24)
    weight = _randn(24, seed=5)
    out = rms_norm_triton(q, weight, 1e-6)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_reference(q, weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_low_precision(dtype):
    x = _randn(6, 64, dtype=dtype, seed=6) * 2
    residual = _randn(6, 64, dtype=dtype, seed=7)
    weight = _randn(64, dtype=dtype, seed=8)
    out, res = rms_norm_triton(x, weight, 1e-5, residual)
    ref, ref_res = rms_norm_reference(x, weight, 1e-5, residual)
    assert out.dtype == res.dtype == dtype
    assert torch.equal(res, ref_res)  # the residual sum rounds exactly like torch's
    # At most one ulp apart where the variance's summation order flips a rounding.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------- RoPE


@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"), [(24, 4, 2), (64, 3, 1), (64, 8, 8)])
def test_rotary_matches_reference_and_layer(head_dim, num_heads, num_kv_heads):
    rope = RotaryEmbedding(head_dim, 128, 10000.0, device=DEVICE, ops=OPS)
    positions = torch.tensor([0, 5, 6, 7, 127, 3, 64], device=DEVICE)
    t = positions.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(t, q_size + 2 * kv_size, seed=9)
    query = qkv[:, :q_size].view(t, num_heads, head_dim)  # strided views, as the model has them
    key = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
    q_out, k_out = rotary_triton(positions, query, key, rope.cos_sin_cache)
    q_ref, k_ref = rotary_reference(positions, query, key, rope.cos_sin_cache)
    q_layer, k_layer = rope(positions, query, key)
    for out, ref, layer in ((q_out, q_ref, q_layer), (k_out, k_ref, k_layer)):
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out, layer, atol=1e-6, rtol=1e-6)
    # In place, into the fused buffer.
    q_in, k_in = rotary_triton(positions, query, key, rope.cos_sin_cache, inplace=True)
    assert q_in.data_ptr() == query.data_ptr()
    torch.testing.assert_close(query, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key, k_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_low_precision_rounds_like_torch(dtype):
    rope = RotaryEmbedding(24, 64, 10000.0, dtype=dtype, device=DEVICE)
    positions = torch.tensor([1, 2, 40, 63, 0], device=DEVICE)
    query, key = _randn(5, 4, 24, dtype=dtype, seed=10), _randn(5, 2, 24, dtype=dtype, seed=11)
    q_out, k_out = rotary_triton(positions, query, key, rope.cos_sin_cache)
    q_ref, k_ref = rotary_reference(positions, query, key, rope.cos_sin_cache)
    assert q_out.dtype == dtype
    torch.testing.assert_close(q_out, q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_out, k_ref, atol=0, rtol=0)


# ---------------------------------------------------------------- native, on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_norm_and_rope_at_model_shapes(dtype):
    x, residual = _randn(300, 4096, dtype=dtype, seed=12), _randn(300, 4096, dtype=dtype, seed=13)
    weight = _randn(4096, dtype=dtype, seed=14)
    out, res = rms_norm_triton(x, weight, 1e-5, residual)
    ref, ref_res = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)
    rope = RotaryEmbedding(128, 8192, 500000.0, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 8192, (300,), device=DEVICE)
    query, key = _randn(300, 32, 128, dtype=dtype, seed=15), _randn(300, 8, 128, dtype=dtype, seed=16)
    q_out, k_out = rotary_triton(positions, query, key, rope.cos_sin_cache)
    q_ref, k_ref = rotary_reference(positions, query, key, rope.cos_sin_cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_out, k_ref, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- SiluAndMul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [24, 1536])
def test_silu_and_mul(dtype, d):
    x = _randn(5, 2 * d, dtype=dtype, seed=17) * 4
    out = silu_and_mul_triton(x)
    ref = silu_and_mul_reference(x)
    assert out.dtype == dtype and out.shape == (5, d)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(out, silu_and_mul(x), **tol)
