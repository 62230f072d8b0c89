"""cpu_gemm.c's bf16 GEMM: exact where float32 sums are exact, within float32 summation error of float64
elsewhere, at every tail of its 6-row x 64-column tiles, and the same bits for any thread count."""

import pytest
import torch
import torch.nn.functional as F

from aioengine.gpu.cpu.linear import PackedLinear
from aioengine.kernels.cpu import clib as cpu_kernels
from aioengine.kernels.cpu import isa

needs_gemm = pytest.mark.skipif(
    not cpu_kernels.gemm_available(), reason="needs the AVX512-BF16 build of the C kernels"
)


def test_the_gemm_is_built_exactly_at_the_avx512_bf16_level():
    """So that a broken build cannot pass as skips on such a machine (this one and CI's), and the AVX2 and
    AVX-512 builds keep oneDNN's linears."""
    if cpu_kernels.load() is None:
        assert not isa.runnable_levels() or cpu_kernels.env.c_compiler() is None
        return  # nothing built here; the rest of the file skips
    assert cpu_kernels.gemm_available() == (cpu_kernels.loaded_level() == "avx512-bf16")


# (rows, out_features, in_features): row tails 1-5 of a 6-row block, a 240-row chunk boundary, column
# tails of a 64-wide panel, odd K (a last pair with one element), the model's own shapes.
SHAPES = [
    (1, 1, 1),
    (2, 15, 3),
    (5, 64, 2),
    (6, 65, 65),
    (7, 130, 64),
    (13, 100, 63),
    (64, 960, 576),
    (64, 576, 1536),
    (241, 200, 96),
    (500, 64, 33),
    (1, 49152 // 16, 576),
]


def _ints(shape, gen):
    return torch.randint(-3, 4, shape, generator=gen).to(torch.bfloat16)


@needs_gemm
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_is_exact_on_small_integers(m, n, k, bias):
    """Products and sums of small integers are exact in float32, so the one rounding is to bf16: the
    result must equal the exact sum rounded, bit for bit (a wrong pair, panel or tail shows here)."""
    gen = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    x, w = _ints((m, k), gen), _ints((n, k), gen)
    b = _ints((n,), gen) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double()).to(torch.bfloat16)
    assert torch.equal(PackedLinear(w, b)(x), exact)


@needs_gemm
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_gemm_is_within_float32_summation_error_of_float64(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    ref = F.linear(x.double(), w.double(), b.double())
    got = PackedLinear(w, b)(x).double()
    # float32 sums of k products: |error| <= k * 2^-24 * sum|x w| (+ |b|); then one bf16 rounding:
    # half an ulp.
    magnitude = F.linear(x.double().abs(), w.double().abs(), b.double().abs())
    half_ulp = 2.0 ** (torch.frexp(ref.abs().clamp_min(1e-30)).exponent.double() - 9)
    assert ((got - ref).abs() <= half_ulp + (k + 1) * 2.0**-24 * magnitude * 1.01).all()
    assert (
        got != F.linear(x, w, b).double()
    ).float().mean() < 0.01  # F.linear (oneDNN) sums in another order


@needs_gemm
def test_gemm_takes_strided_rows_and_3d_inputs():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(70, 40, generator=gen).to(torch.bfloat16)
    wide = torch.randn(9, 100, generator=gen).to(torch.bfloat16)
    x = wide[:, 30:70]  # rows 100 elements apart
    linear = PackedLinear(w, None)
    want = linear(x.contiguous())
    assert torch.equal(linear(x), want)
    assert torch.equal(linear(x.contiguous().view(3, 3, 40)), want.view(3, 3, 70))
    assert linear(x[:0]).shape == (0, 70)


@needs_gemm
def test_gemm_bits_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(960, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(64, 576, generator=gen).to(torch.bfloat16)
    linear = PackedLinear(w, None)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(linear(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_gemm
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_float32_out_is_the_unrounded_sum(m, n, k):
    """The LM head's float32 logits: the same sums as the bf16 output, before its one rounding."""
    gen = torch.Generator().manual_seed(5 + m + n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    head = PackedLinear(w, b, float32_out=True)
    sums = head(x)
    assert sums.dtype == torch.float32 and sums.shape == (m, n)
    assert torch.equal(sums.to(torch.bfloat16), PackedLinear(w, b)(x))
    ints = torch.randint(-3, 4, (m, k), generator=gen).to(torch.bfloat16)
    int_w = torch.randint(-3, 4, (n, k), generator=gen).to(torch.bfloat16)
    exact = F.linear(ints.double(), int_w.double()).float()
    assert torch.equal(PackedLinear(int_w, None, float32_out=True)(ints), exact)


@needs_gemm
@pytest.mark.parametrize(
    ("activation", "torch_op"),
    [("silu", F.silu), ("gelu_tanh", lambda g: F.gelu(g, approximate="tanh"))],
)
@pytest.mark.parametrize(("m", "inter", "k"), [(1, 32, 64), (7, 64, 33), (64, 1536, 576), (241, 96, 96)])
def test_gated_activation_epilogue_matches_the_torch_ops(m, inter, k, activation, torch_op):
    """gate_up packed gated, activation in the epilogue: torch's bits (bf16 after the GEMM, the activation
    looked up from torch's own values, bf16 after the product). With silu computed by the C library's expf
    instead, 0.05% of these differed (a float32 silu on a bf16 tie, e.g. silu(5.9375))."""
    gen = torch.Generator().manual_seed(m + inter + k)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.3).to(torch.bfloat16)
    fused = PackedLinear(w, None, activation=activation)
    got = fused(x)
    gate_up = PackedLinear(w, None)(x)
    want = torch_op(gate_up[:, :inter].contiguous()) * gate_up[:, inter:]  # HF's gate_proj output: contiguous
    assert got.shape == want.shape == (m, inter)
    assert torch.equal(got, want)


def test_pack_linears_fuses_the_mlp_activation_into_gate_up():
    from torch import nn

    from aioengine.gpu.cpu.linear import pack_linears
    from aioengine.gpu.layers import GeluTanhAndMul, SiluAndMul

    mlp = nn.Module()
    mlp.gate_up_proj = nn.Linear(32, 128, bias=False, dtype=torch.bfloat16)
    mlp.act_fn = SiluAndMul()
    geglu = nn.Module()  # Gemma's MLP
    geglu.gate_up_proj = nn.Linear(32, 128, bias=False, dtype=torch.bfloat16)
    geglu.act_fn = GeluTanhAndMul()
    odd = nn.Module()  # 2 x 40 rows: not a multiple of 64, keeps the separate activation
    odd.gate_up_proj = nn.Linear(32, 80, bias=False, dtype=torch.bfloat16)
    odd.act_fn = SiluAndMul()
    x = torch.randn(5, 32).to(torch.bfloat16)
    want = [m.act_fn(m.gate_up_proj(x)) for m in (mlp, geglu)]
    model = nn.Sequential(mlp, geglu, odd)
    pack_linears(model)
    fused = cpu_kernels.gemm_available()
    assert isinstance(mlp.act_fn, nn.Identity) == fused and isinstance(odd.act_fn, SiluAndMul)
    assert isinstance(geglu.act_fn, nn.Identity) == fused
    for m, w in zip((mlp, geglu), want, strict=True):
        torch.testing.assert_close(m.act_fn(m.gate_up_proj(x)), w)


@needs_gemm
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 1, 8), (5, 100, 64), (13, 130, 33), (241, 200, 96), (64, 4096, 64)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_argmax_epilogue_is_torch_argmax_of_the_float32_logits(m, n, k, bias):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    head = PackedLinear(
        w, torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None, float32_out=True
    )
    assert torch.equal(head.argmax(x), head(x).argmax(-1))


@needs_gemm
def test_argmax_epilogue_takes_ties_nans_and_infinities_as_torch_does():
    w = torch.zeros(200, 4)
    w[70] = w[150] = 1.0  # a tie across panels: the first wins
    w[20] = w[30] = -1.0
    x = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.0] * 4])  # row 2: all zero, index 0
    nan = w.clone()
    nan[199, 0] = float("nan")  # the last panel's NaN beats every value
    neg_inf = torch.full((200, 4), float("-inf"))
    for weight, xs in ((w, x), (nan, x), (neg_inf, torch.ones(2, 4)), (w[:65], x)):
        head = PackedLinear(weight.to(torch.bfloat16), None, float32_out=True)
        xs = xs.to(torch.bfloat16)
        assert torch.equal(head.argmax(xs), head(xs).argmax(-1)), weight.shape
    assert PackedLinear(w.to(torch.bfloat16), None, float32_out=True).argmax(
        x.to(torch.bfloat16)
    ).tolist() == [70, 20, 0]


@needs_gemm
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_epilogue_keeps_the_first_of_many_ties_whatever_the_thread_split(threads):
    """Small integer weights make exact ties common, within a lane, across lanes, panels and threads (each
    thread keeps per-lane maxima of its own panels; the merge takes the lowest column of the maximum)."""
    gen = torch.Generator().manual_seed(threads)
    w = torch.randint(-1, 2, (1000, 4), generator=gen).to(torch.bfloat16)
    x = torch.randint(-1, 2, (70, 4), generator=gen).to(torch.bfloat16)
    nan = w.clone()
    nan[[900, 300, 901], 2] = float("nan")  # every row: NaN at 300 and 900 (in different threads' panels)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for weight in (w, nan):
            head = PackedLinear(weight, None, float32_out=True)
            want = head(x).argmax(-1)
            assert torch.equal(head.argmax(x), want)
    finally:
        torch.set_num_threads(before)
    assert (want == 300).all()  # 0 * NaN is NaN as well: every row has NaN logits, the first at 300
    ties = (head := PackedLinear(w, None, float32_out=True))(x)
    assert ((ties == ties.max(-1, keepdim=True).values).sum(-1) > 1).float().mean() > 0.5  # ties are common
