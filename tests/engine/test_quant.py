"""Weight-only int4/int8: the codes round-trip, both kernel paths agree, and the engine equals transformers
running the same dequantized weights, token for token."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from torch import nn

from aioengine.gpu.cpu.quant import (
    QuantizedLinear,
    dequantize_int4,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from tests.engine.test_parity import hf_greedy, prompts, run_engine


def test_int4_codes_reproduce_q4_1_blocks_exactly():
    # A Q4_1-style weight (every group spans codes 0..15) comes back bit for bit, as the default model does.
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 64), dtype=torch.int32)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = torch.rand(32, 2) * 0.01 + 1e-3
    m = torch.randn(32, 2) * 0.1
    w = q.view(32, 2, 32).float() * d[..., None] + m[..., None]
    codes, scale, zero = quantize_int4(w.view(32, 64))
    assert torch.equal(codes, q)
    torch.testing.assert_close(dequantize_int4(codes, scale, zero), w.view(32, 64), rtol=0, atol=1e-6)


def test_int4_and_int8_error_is_within_half_a_step():
    w = torch.randn(48, 96)
    q, scale, zero = quantize_int4(w)
    step = scale.repeat_interleave(32, 1)
    assert ((dequantize_int4(q, scale, zero) - w).abs() <= step / 2 + 1e-6).all()
    q8, s8 = quantize_int8(w)
    assert ((q8.float() * s8[:, None] - w).abs() <= s8[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("method", ["int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("c_kernels", [True, False], ids=["c", "torch"])
def test_quantized_linear_matches_its_dequantized_weight(method, dtype, rows, c_kernels):
    torch.manual_seed(1)
    lin = nn.Linear(64, 48, bias=True)
    q = QuantizedLinear(lin.weight.data.to(dtype), lin.bias.data.to(dtype), method, c_kernels=c_kernels)
    x = torch.randn(rows, 64, dtype=dtype)
    ref = x.double() @ q.weight.double().t() + q.bias.double()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(q(x).double(), ref, rtol=tol, atol=tol)
    assert q(x).shape == (rows, 48)
    torch.testing.assert_close(q(x.view(1, rows, 64)).view(rows, 48), q(x))  # 3-D inputs too


def test_float32_int4_rows_take_the_affine_block_code_kernel(monkeypatch):
    """Where the level vectorizes the block codes, float32 int4 rows run on the affine 4-bit kernel the level
    prefers, cpu_q4_f32.c's FMAs or cpu_q8.c's dots (torch's int4 kernel ran 3x slower than the unquantized
    model on AVX2); past the few rows, the GEMM. Both kernels give the dequantized weight's product."""
    from aioengine.kernels.cpu import clib, q8

    if clib.load() is None or not q8.available():
        pytest.skip("the block-code kernels are not vectorized here")
    torch.manual_seed(2)
    lin = nn.Linear(128, 48, bias=True)
    q = QuantizedLinear(lin.weight.data, lin.bias.data, "int4")
    assert q.int4_mins is not None and q.packed.dtype == torch.uint8 and q.packed.shape == (48, 64)
    assert q.fma == q8.f32_fma()
    calls = []
    name = "q4f_gemv" if q.fma else "qgemv_f32"
    real = getattr(q8, name)
    monkeypatch.setattr(q8, name, lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    x = torch.randn(3, 128)
    torch.testing.assert_close(q(x), nn.functional.linear(x, q.weight, q.bias), rtol=1e-5, atol=1e-5)
    q(torch.randn(q.max_rows_quantized + 1, 128))
    assert calls == [3]
    bf16 = QuantizedLinear(lin.weight.data.bfloat16(), lin.bias.data.bfloat16(), "int4")
    assert bf16.int4_mins is None  # bf16 rows keep torch's int4 kernel


def test_quantize_model_rejects_unknown_methods_and_skips_odd_shapes(caplog):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 20))  # 20 outputs: not a multiple of 16
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(model, "int3")
    assert quantize_model(model, "int4") == 1
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is nn.Linear
    assert "kept unquantized" in caplog.text


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_engine_greedy_parity_with_transformers(tiny_checkpoint, method):
    """Mixed batches: prefill chunks take the dequantized GEMM, small decode batches the packed kernel."""
    kind, path, hf = tiny_checkpoint
    ours = copy.deepcopy(hf)
    with torch.no_grad():
        for name, module in ours.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
                module.weight.copy_(QuantizedLinear(module.weight.data, None, method).weight)
        # transformers' stacked experts [E, rows, cols] (gpt-oss: [E, cols, rows]), each alone; not biases
        in_out = ours.config.model_type == "gpt_oss"
        for name, p in ours.named_parameters():
            if ".experts." in name and p.dim() == 3:
                for w in p.data:
                    if in_out:
                        w.copy_(QuantizedLinear(w.t().contiguous(), None, method).weight.t())
                    else:
                        w.copy_(QuantizedLinear(w, None, method).weight)
        head = ours.get_output_embeddings()
        if ours.config.tie_word_embeddings:  # the engine quantizes a copy for the head only
            head.weight = nn.Parameter(head.weight.detach().clone())
        head.weight.copy_(QuantizedLinear(head.weight.data, None, method).weight)
    ps = prompts(shared_prefix=False, n=12)
    expected = [hf_greedy(ours, p) for p in ps[:6]]
    # Six prompts decode at up to 6 rows (packed kernel); twelve prompts at 12 rows (the GEMM).
    got_small, _ = asyncio.run(run_engine(path, ps[:6], max_num_batched_tokens=64, quantization=method))
    assert got_small == expected
    got_large, _ = asyncio.run(run_engine(path, ps, max_num_batched_tokens=256, quantization=method))
    assert got_large[:6] == expected
