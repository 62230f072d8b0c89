"""Prepacked bf16 linears: oneDNN's layout gives F.linear's bits for any row count; pack_linears swaps them
in. (cpu_gemm.c's layout, the default where it is built: tests/kernels/cpu/test_gemm.py.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aioengine.gpu.cpu.linear import PackedLinear, TransposedLinear, pack_linears, packing_enabled

pytestmark = pytest.mark.skipif(
    not packing_enabled(torch.empty(1, dtype=torch.bfloat16)), reason="this CPU's oneDNN has no bf16 kernels"
)


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_equals_f_linear_bit_for_bit(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    packed = PackedLinear(weight, b, c_gemm=False)  # KernelConfig.cpu_linear='onednn'
    assert not packed.c_gemm
    assert torch.equal(packed(x), F.linear(x, weight, b))
    assert torch.equal(packed(x.view(1, rows, 64)), F.linear(x, weight, b).view(1, rows, 96))


def test_pack_linears_replaces_bf16_layers_and_a_tied_head():
    model = nn.Module()
    model.proj = nn.Linear(32, 48, dtype=torch.bfloat16)
    model.fp32 = nn.Linear(32, 48)  # float32: transposed, not packed
    model.lm_head = nn.Embedding(100, 32, dtype=torch.bfloat16)
    table = model.lm_head.weight
    plain = nn.Linear(32, 48)
    plain.load_state_dict(model.fp32.state_dict())
    assert pack_linears(model) == 3
    assert isinstance(model.proj, PackedLinear) and isinstance(model.fp32, TransposedLinear)
    x = torch.randn(3, 7, 32)
    torch.testing.assert_close(model.fp32(x), plain(x), rtol=1e-6, atol=1e-6)
    assert isinstance(model.lm_head, PackedLinear)
    h = torch.randn(5, 32, dtype=torch.bfloat16)
    logits = model.lm_head(h)
    if model.lm_head.c_gemm:  # cpu_gemm.c's head: the float32 sums, unrounded
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, F.linear(h.float(), table.float()), rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(logits, F.linear(h, table))


def test_packing_can_be_turned_off():
    model = nn.Module()
    model.proj = nn.Linear(32, 48, dtype=torch.bfloat16)
    assert pack_linears(model, "torch") == 0  # KernelConfig.cpu_linear='torch'
    assert type(model.proj) is nn.Linear
    assert pack_linears(model, "onednn") == 1 and not model.proj.c_gemm


def test_float32_linears_and_a_tied_float32_head_are_transposed():
    model = nn.Module()
    model.proj = nn.Linear(32, 48, bias=False)
    model.lm_head = nn.Embedding(100, 32)
    table = model.lm_head.weight
    assert pack_linears(model) == 2
    assert isinstance(model.lm_head, TransposedLinear) and model.lm_head.weight_t.is_contiguous()
    h = torch.randn(4, 32)
    torch.testing.assert_close(model.lm_head(h), F.linear(h, table), rtol=1e-6, atol=1e-6)
    assert pack_linears(model, "torch") == 0  # cpu_linear='torch' keeps plain layers
