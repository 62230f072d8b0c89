"""The NEON build of the C kernels, cross-compiled with aarch64-linux-gnu-gcc and run under qemu-aarch64:
a small C harness (kernel_harness.c) runs each kernel on inputs written here, and its outputs are checked
against the torch reference computed on this host. Two builds: with dotprod (sdot) and plain ARMv8-A (widening
multiplies). The harness is built without OpenMP, as Apple's clang builds the kernels.

Not tested here: speed (qemu emulates), and the Python side on a real aarch64 host (tests/kernels/cpu/
test_isa.py checks that it picks the NEON level there)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from aioengine.kernels import reference
from aioengine.kernels.cpu import clib, q8
from tests.kernels.cpu.test_q8 import XQ_MAX, _affine_case, _near_ties, _q8_0_case, cut_bound

CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
pytestmark = [
    pytest.mark.skipif(
        shutil.which(CROSS) is None or shutil.which(QEMU) is None,
        reason="needs Debian's gcc-aarch64-linux-gnu and qemu-user (.ci/run installs them)",
    ),
    pytest.mark.skipif(clib.load() is None, reason="the host's kernels pack the codes"),
]
BUILDS = {"dotprod": frozenset({"asimd", "asimddp", "i8mm"}), "armv8-a": frozenset({"asimd"})}


@pytest.fixture(scope="module", params=list(BUILDS))
def harness(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"neon-{request.param}")
    here = Path(__file__).with_name("kernel_harness.c")
    return clib.build(
        CROSS, "neon", out, cpu_flags=BUILDS[request.param], extra=(here,), executable=True, openmp=False
    )


def _run(harness: Path, kernel: str, params: list[int], arrays: list[torch.Tensor], dtype, shape, tmp_path):
    blob = struct.pack(f"<q{len(params)}q", len(params), *params)
    for a in arrays:
        data = (
            a.contiguous().view(torch.uint8).numpy().tobytes()
            if a.dtype == torch.bfloat16
            else a.numpy().tobytes()
        )
        blob += struct.pack("<q", len(data)) + data
    (tmp_path / "in.bin").write_bytes(blob)
    run = subprocess.run(
        [QEMU, str(harness), kernel, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, (run.returncode, run.stderr)
    raw = np.frombuffer(
        (tmp_path / "out.bin").read_bytes(), np.int16 if dtype == torch.bfloat16 else np.float32
    )
    return torch.from_numpy(raw.copy()).view(dtype).view(shape)


def test_the_harness_is_the_neon_level_with_vectorized_codes(harness):
    run = subprocess.run([QEMU, str(harness), "level"], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["4", "1"]  # cpu_isa.c's code for neon; cpu_q8_dot.h's NEON dots


@pytest.mark.parametrize(("block", "limbs"), [(32, 3), (32, 2), (16, 3)])
@pytest.mark.parametrize("rows", [1, 5])
def test_q8_codes_float32_rows(harness, tmp_path, block, limbs, rows):
    n, k = 37, 640
    x, q, scale = _q8_0_case(rows, n, k, rows + block + limbs)
    if block == 16:  # Q6_K's blocks: 6-bit codes, a scale per 16
        q = q.clamp(-32, 31)
        scale = torch.rand(n, k // 16, generator=torch.Generator().manual_seed(3)) * 0.01 + 1e-4
    w = (q.double().view(n, -1, block) * scale.double()[..., None]).view(n, k)
    got = _run(
        harness,
        "qgemv_q8_f32",
        [rows, n, k, block, limbs, 0],
        [x, q8.pack(q, block), scale],
        torch.float32,
        (rows, n),
        tmp_path,
    ).double()
    xd = x.double()
    bound = cut_bound(xd, w, limbs)
    want = xd @ w.t()
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


@pytest.mark.parametrize("limbs", [3, 2])
def test_screened_argmax_is_the_exact_sums_argmax(harness, tmp_path, limbs):
    """The greedy screen's one-byte dots (NEON's own) then the exact sums of the outputs that could win: the
    argmax of the same build's exact logits, over near ties."""
    rows, n, k = 16, 3001, 576
    q, scale = _near_ties(n, k, 32, limbs)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(limbs))
    x *= torch.logspace(-3, 1, k // 32).repeat_interleave(32)
    arrays = [x, q8.pack(q), scale]
    params = [rows, n, k, 32, limbs]
    logits = _run(harness, "qgemv_q8_f32", [*params, 0], arrays, torch.float32, (rows, n), tmp_path)
    picks = _run(
        harness,
        "qgemv_q8_argmax",
        params,
        [*arrays, q8.screen_scales(scale)],
        torch.int64,
        (rows,),
        tmp_path,
    )
    assert picks.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4])
def test_affine_4bit_codes(harness, tmp_path, dtype, rows):
    """Q4_1's codes with offsets (the default model's decode path)."""
    n, k = 33, 576
    x, q, scale, mins, w = _affine_case(rows, n, k, rows * 3 + 1)
    x = x.to(dtype)
    packed = q8.pack4(q)
    if dtype == torch.float32:
        got = _run(
            harness,
            "qgemv_q8_f32",
            [rows, n, k, 32, 3, 1],
            [x, packed, scale, mins],
            dtype,
            (rows, n),
            tmp_path,
        )
    else:
        got = _run(
            harness,
            "qgemv_q8_bf16",
            [rows, n, k, 32, 1],
            [x, packed, scale, mins],
            dtype,
            (rows, n),
            tmp_path,
        )
    xd, got = x.double(), got.double()
    want = xd @ w.t()
    limbs = 3 if dtype == torch.float32 else 2
    sx = xd.abs().view(rows, -1, 4).amax(-1) / XQ_MAX[limbs]
    dq = (q.double().view(n, -1, 32) * scale.double()[..., None]).view(n, k)
    bound = (sx / 2).repeat_interleave(4, dim=1) @ w.abs().t() + 2e-6 * (
        xd.abs() @ (dq.abs() + w.abs()).t() + 1
    )
    if dtype == torch.bfloat16:
        bound += want.abs() * 2.0**-8
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_per_channel_codes(harness, tmp_path, rows):
    """--quantization int8's float32 rows (cpu_qgemv.c), k not a multiple of the vector width."""
    g = torch.Generator().manual_seed(rows)
    n, k = 45, 203
    x, q = torch.randn(rows, k, generator=g), torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    got = _run(harness, "qgemv_int8_f32", [rows, n, k], [x, q, scale], torch.float32, (rows, n), tmp_path)
    torch.testing.assert_close(got, x @ (q.float() * scale[:, None]).t(), rtol=1e-5, atol=1e-5)


def test_add_rms_norm(harness, tmp_path):
    g = torch.Generator().manual_seed(0)
    rows, hidden, eps = 7, 576, 1e-5
    x, residual = (torch.randn(rows, hidden, generator=g) * 3 for _ in range(2))
    weight = torch.randn(hidden, generator=g)
    got = _run(
        harness,
        "add_rms_norm_f32",
        [rows, hidden, round(eps * 1e9)],
        [x, residual, weight],
        torch.float32,
        (2, rows, hidden),
        tmp_path,
    )
    want, summed = reference.add_rms_norm(x, weight, eps, residual)
    assert torch.equal(got[1], summed)
    torch.testing.assert_close(got[0], want, rtol=2e-6, atol=2e-6)  # the sum of squares in another order


def test_rotary(harness, tmp_path):
    g = torch.Generator().manual_seed(1)
    tokens, heads, head_dim = 9, 5, 64
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(512).float()[:, None] * inv
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    cos, sin = cache.chunk(2, dim=-1)
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    x = torch.randn(tokens, heads, head_dim, generator=g) * 4
    positions = torch.randint(0, 512, (tokens,), generator=g)
    got = _run(
        harness,
        "rotary_f32",
        [tokens, heads, head_dim],
        [x, positions, cos2, sin2],
        torch.float32,
        (tokens, heads, head_dim),
        tmp_path,
    )
    torch.testing.assert_close(got, reference.rotary(positions, x, x, cache)[0], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("window", "lens"), [(0, (1, 20, 48)), (5, (1, 20, 48)), (0, (1, 300, 600)), (290, (1, 300, 600))]
)
def test_decode_attention(harness, tmp_path, window, lens):
    """Paged decode attention (GQA, a partial last block, a sliding window; sequences past 256 positions cut
    into runs and merged) against softmax(q K^T) V."""
    g = torch.Generator().manual_seed(2)
    reqs, hq, hkv, d, bs = 3, 6, 2, 64, 16
    per_req = -(-max(lens) // bs)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    blocks = reqs * per_req
    k_cache, v_cache = (torch.randn(blocks, bs, hkv, d, generator=g) for _ in range(2))
    table = torch.randperm(blocks, generator=g).view(reqs, per_req).to(torch.int32)
    query = torch.randn(reqs, hq, d, generator=g)
    scale = d**-0.5
    got = _run(
        harness,
        "decode_attention_f32",
        [reqs, hq, hkv, d, bs, per_req, round(scale * 1e9), window],
        [query, k_cache, v_cache, table, seq_lens],
        torch.float32,
        (reqs, hq, d),
        tmp_path,
    )
    for r in range(reqs):
        n = int(seq_lens[r])
        keys = k_cache[table[r].long()].reshape(-1, hkv, d)[:n]
        values = v_cache[table[r].long()].reshape(-1, hkv, d)[:n]
        if window:
            keys, values = keys[-window:], values[-window:]
        keys, values = keys.repeat_interleave(hq // hkv, 1), values.repeat_interleave(hq // hkv, 1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", query[r].double(), keys.double()) * scale, -1)
        want = torch.einsum("ht,thd->hd", probs, values.double()).float()
        torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-5)


def test_fused_moe_on_affine_4bit_codes(harness, tmp_path):
    """cpu_q4_f32.c's moe_q4f_f32 (a GGUF's Q4_K experts, one call a layer): uneven loads, an idle expert."""
    from aioengine.kernels.reference_moe import StackedExperts, fused_moe_by_expert

    g = torch.Generator().manual_seed(7)
    num, hidden, inter, tokens, top_k = 4, 128, 64, 3, 2
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # expert 2 takes every token, expert 3 none
    weights = torch.rand(tokens, top_k, generator=g)
    arrays: list[torch.Tensor] = [x, ids, weights]
    dense = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        q = torch.randint(0, 16, (num, n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(num, n, k // 32, generator=g) * 0.02 + 1e-3
        mins = -torch.rand(num, n, k // 32, generator=g) * 0.1
        arrays += [torch.stack([q8.pack4_f32(q[e].contiguous()) for e in range(num)]), scale, mins]
        dense.append(q.double().view(num, n, -1, 32) * scale.double()[..., None] + mins.double()[..., None])
    w13, w2 = (d.reshape(num, d.shape[1], -1) for d in dense)
    got = _run(harness, "moe_q4f_f32", [tokens, hidden, inter, top_k, num], arrays, torch.float32,
               (tokens, hidden), tmp_path)  # fmt: skip
    want = fused_moe_by_expert(x.double(), StackedExperts(w13, w2), weights.double(), ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 12])
def test_affine_4bit_float32_fmas(harness, tmp_path, rows):
    """cpu_q4_f32.c's q4f_gemv_f32: x as it is against d q + m, in passes of 4 rows (3) and on panels
    of 16 outputs widened once (12 rows: two tiles of 6; 37 outputs leave a short last panel)."""
    g = torch.Generator().manual_seed(rows)
    n, k = 37, 128
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // 32, generator=g) * 0.1
    got = _run(harness, "q4f_gemv_f32", [rows, n, k], [x, q8.pack4_f32(q), scale, mins], torch.float32,
               (rows, n), tmp_path)  # fmt: skip
    w = (q.double().view(n, -1, 32) * scale.double()[..., None] + mins.double()[..., None]).view(n, k)
    torch.testing.assert_close(got.double(), x.double() @ w.t(), rtol=1e-5, atol=1e-5)
