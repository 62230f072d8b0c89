"""oneDNN-prepacked bf16 linears: the same bits as F.linear for any row count, and the runner uses them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aioengine.gpu.cpu_linear import PackedLinear, pack_linears, packing_enabled

pytestmark = pytest.mark.skipif(not packing_enabled(torch.empty(1, dtype=torch.bfloat16)),
                                reason="this CPU's oneDNN has no bf16 kernels")


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    packed = PackedLinear(weight, b)
    assert torch.equal(packed(x), F.linear(x, weight, b))
    assert torch.equal(packed(x.view(1, rows, 64)), F.linear(x, weight, b).view(1, rows, 96))


def test_pack_linears_replaces_bf16_layers_and_a_tied_head():
    model = nn.Module()
    model.proj = nn.Linear(32, 48, dtype=torch.bfloat16)
    model.fp32 = nn.Linear(32, 48)  # float32 stays plain (parity dtype)
    model.lm_head = nn.Embedding(100, 32, dtype=torch.bfloat16)
    table = model.lm_head.weight
    assert pack_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and type(model.fp32) is nn.Linear
    assert isinstance(model.lm_head, PackedLinear)
    h = torch.randn(5, 32, dtype=torch.bfloat16)
    assert torch.equal(model.lm_head(h), F.linear(h, table))


def test_packing_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AIOENGINE_PACKED_LINEAR", "0")
    assert not packing_enabled(torch.empty(1, dtype=torch.bfloat16))
