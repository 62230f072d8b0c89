"""cpu_q8.c (GEMVs on a GGUF's own block codes) against float64 references of the exact weights."""

from __future__ import annotations

import pytest
import torch

from aioengine.kernels.cpu import clib, q8

pytestmark = pytest.mark.skipif(clib.load() is None, reason="the C kernels cannot be built here")


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
    return xd @ w.t(), cut_bound(xd, w, limbs)


def cut_bound(xd: torch.Tensor, w: torch.Tensor, limbs: int) -> torch.Tensor:
    """What the kernel's one rounding of float64 ``xd`` (``|x - sx xq| <= sx / 2`` per input, with sx = the
    largest |x| of its 4 inputs / XQ_MAX) may move ``xd @ w.T``, plus float32's share of the sums."""
    sx = xd.abs().view(len(xd), -1, 4).amax(-1) / XQ_MAX[limbs]
    return (sx / 2).repeat_interleave(4, dim=1) @ w.abs().t() + 1e-6 * (xd.abs() @ w.abs().t())


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
@pytest.mark.parametrize(("n", "k"), [(48, 64), (33, 576), (1001, 640)])
@pytest.mark.parametrize("limbs", [2, 3])
def test_q8_0_gemv_is_within_its_one_rounding_of_the_exact_weights(rows, n, k, limbs):
    """Odd output counts, more rows than one register block; the packed order of the codes and of x's bytes
    must agree, or the sums mix blocks with each other's scales."""
    x, q, scale = _q8_0_case(rows, n, k, rows * 7 + n + k)
    want, bound = _q8_0_reference(x, q, scale, limbs)
    got = q8.qgemv_f32(x, q8.pack(q), scale, limbs=limbs).double()
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    # far below what rounding the same weights to bf16 (the GEMM's head) costs
    w = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bf16 = x.double() @ w.bfloat16().double().t()
    assert (got - want).abs().mean() < (bf16 - want).abs().mean() / 20


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
def test_q8_0_gemv_reads_strided_rows_and_ties_its_argmax_to_torchs():
    x, q, scale = _q8_0_case(5, 4099, 128, 3)
    q[4000] = q[17]  # equal maxima in different threads' ranges: the first wins
    scale[4000] = scale[17]
    x[2] = 0.0  # an all-zero row: every logit ties at 0, argmax 0
    u = q8.pack(q)
    wide = torch.zeros(5, 160)
    wide[:, :128] = x
    logits = q8.qgemv_f32(wide[:, :128], u, scale)
    torch.testing.assert_close(logits, q8.qgemv_f32(x, u, scale), rtol=0, atol=0)
    logits[:, 17] = logits.max(-1).values + 1  # make 17 (and its twin 4000) the maxima to test the tie
    scale[17] *= 0
    scale[4000] *= 0
    x2 = x.clone()
    got = q8.qgemv_f32(x2, u, scale, argmax=True)
    assert got.tolist() == q8.qgemv_f32(x2, u, scale).argmax(-1).tolist()
    assert got[2] == 0


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
def test_q8_0_argmax_takes_the_first_maximum_across_threads_and_the_first_nan():
    n, k = 6000, 64
    q = torch.zeros(n, k, dtype=torch.int8)
    q[:, 0] = 1
    scale = torch.full((n, 2), 0.5)
    x = torch.zeros(2, k)
    x[:, 0] = 1.0
    scale[[10, 5000], 0] = 2.0  # the largest logit twice, one in each half
    assert q8.qgemv_f32(x, q8.pack(q), scale, argmax=True).tolist() == [10, 10]
    scale[[4000, 5500], 1] = float("nan")  # NaN logits win, the first of them
    got = q8.qgemv_f32(x, q8.pack(q), scale, argmax=True)
    assert got.tolist() == [4000, 4000]
    assert got.tolist() == q8.qgemv_f32(x, q8.pack(q), scale).argmax(-1).tolist()


def _near_ties(n: int, k: int, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes whose largest sums come in near ties: copies of one loud output, each with one code moved by one
    (its sum then differs from the original's by one scale times one input: less than the one-byte cut's
    error, so a screen that trusted its first sums would pick wrong)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // block, generator=g) * 0.01 + 1e-4
    scale[5] *= 4
    for j in range(100, n - 1, 97):
        q[j], scale[j] = q[5], scale[5]
        i = int(torch.randint(0, k, (1,), generator=g))
        q[j, i] = max(-127, min(127, int(q[j, i]) + (1 if j % 2 else -1)))
    q[n - 1], scale[n - 1] = q[5], scale[5]  # an exact tie with 5, in the last thread's range: 5 wins
    return q, scale


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("limbs", [2, 3])
@pytest.mark.parametrize(("block", "k"), [(32, 576), (16, 128)])
def test_screened_argmax_is_the_exact_sums_argmax(rows, limbs, block, k):
    """The screen (x cut to one byte, every output bounded) then the exact sums of the outputs that could
    win: each row's pick equals the argmax of the exact path's logits, near ties and exact ties included,
    past one pass of 16 rows too. Without the bound's margin some of these rows pick wrong."""
    for seed in range(6):
        q, scale = _near_ties(3001 + seed, k, block, seed)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 1, k // 32).repeat_interleave(32)
        u = q8.pack(q, block)
        want = q8.qgemv_f32(x, u, scale, block, limbs=limbs).argmax(-1)
        got = q8.qgemv_f32(x, u, scale, block, argmax=True, limbs=limbs, scale_max=q8.screen_scales(scale))
        assert got.tolist() == want.tolist(), seed


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
def test_screened_argmax_keeps_torchs_ties_nans_and_zero_rows():
    """Ties across the threads' ranges go to the first; a non-finite x or scale falls back to the exact sums
    everywhere (the first NaN logit wins, as torch's argmax); an all-zero row ties everywhere at 0."""
    n, k = 6000, 64
    q = torch.zeros(n, k, dtype=torch.int8)
    q[:, 0] = 1
    scale = torch.full((n, 2), 0.5)
    x = torch.zeros(4, k)
    x[:3, 0] = 1.0
    x[2, 5] = float("inf")  # inf x 0 codes: NaN logits everywhere, the first (0) wins
    scale[[10, 5000], 0] = 2.0
    u = q8.pack(q)

    def screened() -> list[int]:
        return q8.qgemv_f32(x, u, scale, argmax=True, scale_max=q8.screen_scales(scale)).tolist()

    want = q8.qgemv_f32(x, u, scale).argmax(-1).tolist()
    assert screened() == want == [10, 10, 0, 0]
    scale[[4000, 5500], 1] = float("nan")
    want = q8.qgemv_f32(x, u, scale).argmax(-1).tolist()
    assert screened() == want == [4000, 4000, 0, 4000]


def _blocks_case(
    rows: int, n: int, k: int, block: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 rows, int8 codes, per-block scales that differ by block (a block read with its neighbour's
    scale is far off), and the exact weight in float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // block, generator=g) * torch.logspace(-4, -1, k // block)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, k // 16).repeat_interleave(16)).bfloat16()
    w = (q.double().view(n, -1, block) * scale.double()[..., None]).view(n, k)
    return x, q, scale, w


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("block", q8.BLOCKS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (37, 640), (300, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemv_is_within_its_roundings_of_the_exact_weights(block, rows, n, k, with_bias):
    """Each output is the exact weight's dot within the cut of x (2 bytes a 4-input lane) and one bf16
    rounding; odd n repeats its last row internally and must not write past it."""
    x, q, scale, w = _blocks_case(rows, n, k, block, rows * 100 + n + k + block)
    bias = torch.randn(n).bfloat16() if with_bias else None
    wide = torch.zeros(rows, k + 64, dtype=torch.bfloat16)
    wide[:, :k] = x  # strided rows
    got = q8.qgemv_bf16(wide[:, :k], q8.pack(q, block), scale, block, bias).double()
    xd = x.double()
    want = xd @ w.t() + (0 if bias is None else bias.double())
    sx = xd.abs().view(rows, -1, 4).amax(-1) / XQ_MAX[2]
    bound = (sx / 2).repeat_interleave(4, dim=1) @ w.abs().t() + 1e-6 * (xd.abs() @ w.abs().t())
    bound += want.abs() * 2.0**-8  # the bf16 rounding of the result (half an ulp is 2^-9 of it)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu"])
@pytest.mark.parametrize("block", q8.BLOCKS)
def test_bf16_gemv_act_mul_is_torchs_act_of_its_own_gate_times_up(activation, block):
    """Codes in gate/up row pairs: the result is act(gate) * up in torch's bf16 roundings, on the very gate
    and up sums the plain call gives."""
    x, gate_up, scale, _ = _blocks_case(3, 2 * 96, 640, block, 7)
    packed = q8.pack(gate_up, block)
    plain = q8.qgemv_bf16(x, packed, scale, block)
    gate, up = plain[:, 0::2], plain[:, 1::2]
    act = torch.nn.functional.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else _silu(gate)
    got = q8.qgemv_bf16(x, packed, scale, block, activation=activation)
    torch.testing.assert_close(got, act * up, rtol=0, atol=0)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("block", q8.BLOCKS)
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_f32_gemv_takes_blocks_of_16_and_a_bias(block, rows):
    """float32 rows cut to 3 bytes: within float32-sized roundings of the exact weight's dot, plus bias."""
    x, q, scale, w = _blocks_case(rows, 129, 640, block, rows + block)
    x = x.float() * torch.rand(rows, 640)  # past bf16's precision
    bias = torch.randn(129)
    got = q8.qgemv_f32(x, q8.pack(q, block), scale, block, bias, limbs=3).double()
    xd = x.double()
    want = xd @ w.t() + bias.double()
    sx = xd.abs().view(rows, -1, 4).amax(-1) / XQ_MAX[3]
    bound = (sx / 2).repeat_interleave(4, dim=1) @ w.abs().t() + 1e-6 * (xd.abs() @ w.abs().t() + 1)
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def _affine_case(
    rows: int, n: int, k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1-like blocks of 32: codes in [0, 15], a scale and an offset per block, both differing by block (a
    block read with its neighbour's is far off); the exact weight in float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * torch.logspace(-4, -1, k // 32)
    mins = (torch.rand(n, k // 32, generator=g) - 0.7) * 8 * scale
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 1, k // 16).repeat_interleave(16)
    w = (q.double().view(n, -1, 32) * scale.double()[..., None] + mins.double()[..., None]).view(n, k)
    return x, q, scale, mins, w


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize(("n", "k"), [(64, 64), (37, 640), (300, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_affine_4bit_gemv_is_within_its_roundings_of_the_exact_weights(dtype, rows, n, k, with_bias):
    """Nibble-packed codes with offsets: the exact weight's dot within the cut of x (the offsets multiply the
    same cut x), float32's sums and, for bf16, one rounding of the result."""
    x, q, scale, mins, w = _affine_case(rows, n, k, rows * 100 + n + k)
    x = x.to(dtype)
    bias = torch.randn(n).to(dtype) if with_bias else None
    wide = torch.zeros(rows, k + 64, dtype=dtype)
    wide[:, :k] = x  # strided rows
    packed = q8.pack4(q)
    assert packed.shape == (n, k // 2)
    if dtype == torch.bfloat16:
        got = _affine_bf16(wide[:, :k], q, scale, mins, bias).double()
    else:
        got = q8.qgemv_f32(wide[:, :k], packed, scale, 32, bias, limbs=3, mins=mins).double()
    xd = x.double()
    want = xd @ w.t() + (0 if bias is None else bias.double())
    limbs = 2 if dtype == torch.bfloat16 else 3
    sx = xd.abs().view(rows, -1, 4).amax(-1) / XQ_MAX[limbs]
    dq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bound = (sx / 2).repeat_interleave(4, dim=1) @ w.abs().t()
    bound += 2e-6 * (xd.abs() @ (dq.abs() + w.abs()).t() + 1)
    if dtype == torch.bfloat16:
        bound += want.abs() * 2.0**-8
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def _affine_bf16(x, q, scale, mins, bias=None, activation=None):
    """qgemv_bf16 on affine codes, in the layout this CPU's kernel takes."""
    if q8.bf16_dots():
        packed, scale, mins = q8.pack4_tiles(q, scale, mins)
        return q8.qgemv_bf16(x, packed, scale, 32, bias, activation, mins=mins, n_out=q.shape[0])
    return q8.qgemv_bf16(x, q8.pack4(q), scale, 32, bias, activation, mins=mins)


@pytest.mark.skipif(not q8.bf16_dots(), reason="cpu_q4_bf16.c's dots need AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 3, 10, 11, 23])
@pytest.mark.parametrize(("n", "k"), [(37, 640), (300, 1024)])
def test_affine_4bit_bf16_dots_take_x_as_it_is(rows, n, k):
    """With bf16 dots, bf16 rows meet the exact weights with no cut of x: the result is the exact dot but
    for float32's sums and its one bf16 rounding, for every row past the kernel's 10 a pass, and with
    outputs that are not a multiple of 16 (padded in the layout)."""
    x, q, scale, mins, w = _affine_case(rows, n, k, rows * 7 + n + k)
    x = x.bfloat16()
    got = _affine_bf16(x, q, scale, mins).double()
    xd = x.double()
    want = xd @ w.t()
    dq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bound = 2e-6 * (xd.abs() @ (dq.abs() + w.abs()).t()) + want.abs() * 2.0**-8 + 1e-30
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    # each row alone gives the same bits: rows do not see one another
    for r in (0, rows - 1):
        alone = _affine_bf16(x[r : r + 1], q, scale, mins).double()
        assert torch.equal(alone[0], got[r])


@pytest.mark.skipif(not q8.available(), reason="cpu_q8.c is not vectorized at this level")
def test_affine_4bit_act_mul_is_torchs_act_of_its_own_gate_times_up():
    x, gate_up, scale, mins, _ = _affine_case(2, 2 * 64, 576, 5)
    x = x.bfloat16()
    plain = _affine_bf16(x, gate_up, scale, mins)
    got = _affine_bf16(x, gate_up, scale, mins, activation="silu")
    torch.testing.assert_close(got, _silu(plain[:, 0::2]) * plain[:, 1::2], rtol=0, atol=0)


def test_affine_4bit_codes_come_only_in_blocks_of_32():
    x, q, scale, mins, _ = _affine_case(1, 8, 64, 1)
    with pytest.raises(AssertionError):
        q8.qgemv_f32(x, q8.pack4(q), torch.ones(8, 4), 16, mins=torch.ones(8, 4))


TILED_FROM = 10  # cpu_q4_f32.c's QP_FROM: from this many rows the weights are widened once for all


def _same_bits_alone(gemv, x: torch.Tensor, got: torch.Tensor) -> None:
    """Below TILED_FROM rows each row alone gives the batch's bits; from it, any TILED_FROM of the rows do."""
    rows = x.shape[0]
    if rows < TILED_FROM:
        for r in range(0, rows, 4):
            assert torch.equal(gemv(x[r : r + 1].contiguous())[0], got[r].float())
    else:
        tail = x[rows - TILED_FROM :].contiguous()
        assert torch.equal(gemv(tail), got[rows - TILED_FROM :].float())


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 9, 10, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (300, 640), (64, 1536), (20, 4160)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_affine_4bit_float32_fmas_take_x_as_it_is(rows, n, k, with_bias):
    """cpu_q4_f32.c: float32 rows (strided) against the exact weights with no cut of x: the exact dot but
    for float32's sums, for every row past its 4 a pass and on widened panels past 10 rows (odd output
    counts leave a short last panel); a row's bits do not depend on the rows beside it (within each path)."""
    x, q, scale, mins, w = _affine_case(max(rows, 1), n, k, rows * 11 + n + k)
    x = x[:rows]
    bias = torch.randn(n) if with_bias else None
    wide = torch.zeros(rows, k + 64)
    wide[:, :k] = x
    packed = q8.pack4_f32(q)
    assert packed.shape == (n, k // 2)
    got = q8.q4f_gemv(wide[:, :k], packed, scale, mins, bias).double()
    xd = x.double()
    want = xd @ w.t() + (0 if bias is None else bias.double())
    dq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bound = 2e-6 * (xd.abs() @ (dq.abs() + w.abs()).t() + 1)
    assert got.shape == (rows, n) and ((got - want).abs() <= bound).all()
    _same_bits_alone(lambda rows_: q8.q4f_gemv(rows_, packed, scale, mins, bias), x, got)


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 9, 10, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (300, 640), (64, 1536), (20, 4160)])
def test_symmetric_8bit_float32_fmas_take_x_as_it_is(rows, n, k):
    """cpu_q4_f32.c's 8-bit codes (Q8_0's: w = d q, q in [-127, 127], the head's): float32 rows (strided)
    against the exact weights with no cut of x, in passes of 4 rows and on widened panels; a row's bits do not
    depend on the rows beside it (within each path)."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    w = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    x = torch.randn(max(rows, 1), k, generator=g)[:rows]
    wide = torch.zeros(rows, k + 64)
    wide[:, :k] = x
    packed = q8.pack8_f32(q)
    assert packed.shape == (n, k)
    got = q8.q8f_gemv(wide[:, :k], packed, scale).double()
    xd = x.double()
    bound = 2e-6 * (xd.abs() @ w.abs().t() + 1)
    assert got.shape == (rows, n) and ((got - xd @ w.t()).abs() <= bound).all()
    _same_bits_alone(lambda rows_: q8.q8f_gemv(rows_, packed, scale), x, got)
