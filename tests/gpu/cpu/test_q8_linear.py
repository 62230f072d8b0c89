"""gpu/cpu/q8_linear.py: decoder linears on their checkpoint's block codes for a few rows (bf16 and float32),
their own linear past that, and attached only where every block is exact."""

from __future__ import annotations

import pytest
import torch

from aioengine.gpu.cpu.backend import CpuBackend
from aioengine.gpu.cpu.linear import pack_linears
from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.gpu.loader import load_model
from aioengine.kernels.cpu import clib, q8
from tests.engine.conftest import make_tiny_checkpoint
from tests.gpu.cpu.block_coded import as_block_codes, attach_codes

pytestmark = pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is vectorized for AVX512-VNNI only")


def _tiny(tmp_path, arch: str, dtype: torch.dtype, codes: bool = True, q4_1: bool = False):
    hf = make_tiny_checkpoint(
        arch, tmp_path, hidden_size=384, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64, vocab_size=300,
    )  # fmt: skip
    if codes:
        as_block_codes(hf, q4_1=q4_1)
        hf.save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, dtype=dtype, ops=CpuBackend().ops)
    pack_linears(model)
    return model, hf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("q4_1", [False, True])
def test_every_coded_projection_runs_its_codes_for_few_rows_and_its_own_linear_past_them(
    tmp_path, arch, dtype, q4_1
):
    if dtype == torch.bfloat16 and not clib.gemm_available():
        pytest.skip("bf16 linears are packed for cpu_gemm.c only with AVX512-BF16")
    model, hf = _tiny(tmp_path, arch, dtype, q4_1=q4_1)
    assert attach_codes(model, tmp_path) == 4 * 2  # qkv, o, gate_up, down in both layers
    layer, ref = model.model.layers[1], hf.model.layers[1]
    coded = [m for m in model.modules() if isinstance(m, Q8Linear)]
    if q4_1:  # 4-bit codes nibble-packed, with their offsets
        assert all(
            m.block == 32 and m.mins is not None and m.packed.numel() * 2 == m.scales.numel() * 32
            for m in coded
        )
    else:
        assert {layer.mlp.down_proj.block, layer.self_attn.qkv_proj.block} == {16, 32}
        assert all(m.mins is None for m in coded)
    gen = torch.Generator().manual_seed(1)
    for module, weight in (
        (layer.self_attn.qkv_proj, torch.cat([ref.self_attn.q_proj.weight, ref.self_attn.k_proj.weight,
                                              ref.self_attn.v_proj.weight])),
        (layer.self_attn.o_proj, ref.self_attn.o_proj.weight),
        (layer.mlp.down_proj, ref.mlp.down_proj.weight),
    ):  # fmt: skip
        assert isinstance(module, Q8Linear)
        for rows in (1, module.max_rows, module.max_rows + 1):
            x = torch.randn(rows, module.in_features, generator=gen).to(dtype)
            got = module(x)
            if rows > module.max_rows:
                assert torch.equal(got, module.gemm(x))
                continue
            exact = x.double() @ weight.detach().double().t()
            tol = 1e-5 if dtype == torch.float32 else 2.0**-8  # float32's sums; one bf16 rounding
            assert (
                (got.double() - exact).abs() <= tol * (x.double().abs() @ weight.double().abs().t())
            ).all()
    gate_up = layer.mlp.gate_up_proj
    x = torch.randn(2, gate_up.in_features, generator=gen).to(dtype)
    gate = x.double() @ ref.mlp.gate_proj.weight.detach().double().t()
    up = x.double() @ ref.mlp.up_proj.weight.detach().double().t()
    if gate_up.activation is not None:  # bf16: the fused act(gate) * up, from gate/up row pairs
        act = torch.nn.functional.gelu if arch == "gemma3" else torch.nn.functional.silu
        want = (act(gate, approximate="tanh") if arch == "gemma3" else act(gate)) * up
    else:
        want = torch.cat([gate, up], -1)
    torch.testing.assert_close(gate_up(x).double(), want, rtol=0.03, atol=0.03)


def test_plain_weights_and_missing_checkpoints_keep_their_linears(tmp_path):
    model, _ = _tiny(tmp_path, "llama", torch.float32, codes=False)
    assert attach_codes(model, tmp_path) == 0
    assert attach_codes(model, tmp_path / "nowhere") == 0
    assert not any(isinstance(m, Q8Linear) for m in model.modules())


def test_a_step_with_prompt_rows_keeps_the_models_own_linear(tmp_path):
    """Only decode steps take the codes: a prompt's rows give the same result alone as in a batch."""
    model, _ = _tiny(tmp_path, "llama", torch.float32, q4_1=True)
    assert attach_codes(model, tmp_path) == 4 * 2
    steps = model.coded_steps
    o_proj = model.model.layers[0].self_attn.o_proj
    assert o_proj.steps is steps
    x = torch.randn(1, o_proj.in_features)
    on_codes = o_proj(x)
    steps.decodes_only = False
    assert torch.equal(o_proj(x), o_proj.gemm(x)) and not torch.equal(on_codes, o_proj.gemm(x))
