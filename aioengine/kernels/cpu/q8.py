"""Python entry points of cpu_q8.c: GEMVs on a GGUF's own block codes (int8 with a scale per 16 or 32
inputs, or 4-bit with a scale and an offset per 32), and of cpu_q4_f32.c (4-bit and 8-bit codes, float32
FMAs)."""

from __future__ import annotations

import torch

from aioengine.kernels.cpu import clib

BLOCKS = (16, 32)  # the block sizes the kernels take: Q6_K's, and Q8_0/Q5_0/Q4_0's


def available() -> bool:
    """Whether the kernels run vectorized at the loaded level (AVX512-VNNI, AVX2 or NEON; cpu_q8_dot.h):
    elsewhere they are correct but slow."""
    lib = clib.load()
    return lib is not None and bool(lib.qgemv_q8_vectorized())


def bf16_dots() -> bool:
    """Whether ``qgemv_bf16`` with ``mins`` runs AVX512-BF16 dots on x as it is (cpu_q4_bf16.c, codes from
    ``pack4_tiles``) rather than cutting x to 2 bytes per input for the integer dots (``pack4``)."""
    lib = clib.load()
    return lib is not None and bool(lib.q4t_available())


def f32_fma() -> bool:
    """Whether float32 rows against block codes take cpu_q4_f32.c's FMAs at the loaded level (codes from
    ``pack4_f32``/``pack8_f32``, ``q4f_gemv``/``q8f_gemv``) rather than the integer dots (``pack4``/``pack``,
    ``qgemv_f32``): x86 levels without AVX512-VNNI, where the FMAs measured faster (docs/benchmarks.md)."""
    lib = clib.load()
    return lib is not None and bool(lib.q4f_preferred())


def pack4_f32(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Affine 4-bit codes ``q [N, K]`` (uint8 in [0, 15], K a multiple of 64) in cpu_q4_f32.c's layout
    (``[N, K / 2]`` uint8, into ``out`` if given)."""
    n, k = q.shape
    assert q.dtype == torch.uint8 and q.is_contiguous() and k % 64 == 0
    out = torch.empty((n, k // 2), dtype=torch.uint8) if out is None else out.view(n, k // 2)
    assert out.dtype == torch.uint8 and out.is_contiguous()
    _lib().q4f_pack(q.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def q4f_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)``, ``W = q * scale + mins`` per block of 32, for float32 ``x [M, K]`` (unit inner
    stride) and ``packed = pack4_f32(q)``: float32 ``[M, N]``, x as it is (float32's roundings only)."""
    return _fma_gemv(x, packed, scale, mins, bias)


def pack8_f32(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric 8-bit codes ``q [N, K]`` (int8, K a multiple of 64) in cpu_q4_f32.c's 8-bit layout
    (``[N, K]`` uint8, into ``out`` if given)."""
    n, k = q.shape
    assert q.dtype == torch.int8 and q.is_contiguous() and k % 64 == 0
    out = torch.empty((n, k), dtype=torch.uint8) if out is None else out.view(n, k)
    assert out.dtype == torch.uint8 and out.is_contiguous()
    _lib().q8f_pack(q.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def q8f_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ W.T``, ``W = q * scale`` per block of 32, for float32 ``x [M, K]`` (unit inner stride) and
    ``packed = pack8_f32(q)``: float32 ``[M, N]``, x as it is (float32's roundings only)."""
    return _fma_gemv(x, packed, scale, None, None)


def _fma_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """cpu_q4_f32.c's call: 4-bit codes with ``mins``, 8-bit ones without."""
    m, k, n = _shapes(x, torch.float32, packed, scale, 32, bias, mins)
    y = torch.empty((m, n), dtype=torch.float32)
    lib = _lib()
    head = (x.data_ptr(), x.stride(0), packed.data_ptr(), scale.data_ptr())
    tail = (0 if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k, torch.get_num_threads())
    if mins is None:
        status = lib.q8f_gemv_f32(*head, *tail)
    else:
        status = lib.q4f_gemv_f32(*head, mins.data_ptr(), *tail)
    _check(status)
    return y


def moe_q4f(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tables: torch.Tensor,
    intermediate: int,
) -> torch.Tensor:
    """A mixture's routed experts for float32 tokens ``x [T, H]`` (cpu_q4_f32.c's ``moe_q4f_f32``): each
    token's sum over its experts ``topk_ids [T, k]`` of ``topk_weights`` times the expert's SwiGLU, on the
    experts' ``pack4_f32`` codes. ``tables``: int64 ``[6, E]``, the addresses of each expert's gate_up codes,
    scales and mins (``[2I, H]``) and its down's (``[H, I]``); the caller keeps those tensors alive."""
    t, h = x.shape
    e = tables.shape[1]
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if (
        x.dtype != torch.float32
        or not x.is_contiguous()
        or tables.dtype != torch.int64
        or tables.shape[0] != 6
    ):
        raise ValueError("moe_q4f takes contiguous float32 tokens and an int64 [6, E] table")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != t:
        raise ValueError(f"expert ids {list(ids.shape)} and weights {list(weights.shape)} for {t} tokens")
    out = torch.empty_like(x)
    rows = [tables.contiguous().data_ptr() + 8 * e * i for i in range(6)]  # each row, without a view apiece
    status = _lib().moe_q4f_f32(
        x.data_ptr(), t, h, intermediate, ids.shape[1], ids.data_ptr(), weights.data_ptr(), *rows,
        e, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:  # the kernel checks every id once, as it sorts them
        raise ValueError(
            f"an expert id out of range 0..{e - 1}, or H or I not a multiple of 64, or top-k over 64"
        )
    _check(status)
    return out


def pack4_tiles(
    q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine 4-bit codes ``q [N, K]`` (uint8 in [0, 15], K a multiple of 64) with their float32 ``scale``
    and ``mins [N, K / 32]`` in cpu_q4_bf16.c's layout, for ``qgemv_bf16`` where ``bf16_dots()``: outputs in
    tiles of 16 (N padded with zeros), then blocks of 32; returns (codes [N16 * K / 2] uint8, scale, mins
    [N16 / 16, K / 32, 16]). ``out``: N16 * K / 2 uint8 for the codes."""
    n, k = q.shape
    assert q.dtype == torch.uint8 and q.is_contiguous() and k % 64 == 0
    assert scale.shape == mins.shape == (n, k // 32)
    n16 = -(-n // 16) * 16
    out = torch.empty(n16 * k // 2, dtype=torch.uint8) if out is None else out.view(-1)
    assert out.dtype == torch.uint8 and out.is_contiguous() and out.numel() == n16 * k // 2
    _lib().q4t_pack(q.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())

    def tiles(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(n16, k // 32, dtype=torch.float32)
        padded[:n] = t
        return padded.view(n16 // 16, 16, k // 32).transpose(1, 2).contiguous()

    return out.view(n16, k // 2), tiles(scale), tiles(mins)


def pack(q: torch.Tensor, block: int = 32, out: torch.Tensor | None = None) -> torch.Tensor:
    """int8 codes ``q [N, K]`` (K a multiple of 64) in the kernels' layout: uint8 ``q + 128``, each 64-input
    chunk's 4-byte groups taking turns among its ``64 / block`` blocks; into ``out`` (N * K uint8) if
    given."""
    n, k = q.shape
    assert q.dtype == torch.int8 and q.is_contiguous() and k % 64 == 0 and block in BLOCKS
    out = torch.empty((n, k), dtype=torch.uint8) if out is None else out.view(n, k)
    assert out.dtype == torch.uint8 and out.is_contiguous()
    _lib().q8_pack(q.data_ptr(), out.data_ptr(), n, k, block, torch.get_num_threads())
    return out


def pack4(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Affine 4-bit codes ``q [N, K]`` (uint8 in [0, 15], K a multiple of 64) in the kernels' layout: each
    64-input chunk in 32 bytes (``pack``'s order, its first 32 in the low nibbles); into ``out`` (N * K / 2
    uint8) if given."""
    n, k = q.shape
    assert q.dtype == torch.uint8 and q.is_contiguous() and k % 64 == 0
    out = torch.empty((n, k // 2), dtype=torch.uint8) if out is None else out.view(n, k // 2)
    assert out.dtype == torch.uint8 and out.is_contiguous()
    _lib().q4_pack(q.data_ptr(), out.data_ptr(), n, k, torch.get_num_threads())
    return out


def qgemv_f32(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: int = 32,
    bias: torch.Tensor | None = None,
    argmax: bool = False,
    limbs: int = 3,
    mins: torch.Tensor | None = None,
    scale_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with ``W = q * scale`` per ``block`` inputs, for float32 ``x [M, K]`` (unit
    inner stride, a few rows), ``packed = pack(q, block)`` and float32 ``scale [N, K / block]``
    (contiguous): float32 ``[M, N]``, or with ``argmax`` each row's argmax (int64 ``[M]``, as torch picks it)
    without writing the logits. x is rounded once, per 4 inputs, to ``limbs`` bytes: 3 (float32 activations,
    2^-24 of the 4's largest) or 2 (bf16 ones, 2^-16); cpu_q8.c says how. Nothing else is rounded.
    With ``mins`` (float32 ``[N, K / 32]``) the weight is affine, ``W = q * scale + mins`` per block of 32,
    and ``packed = pack4(q)``. With ``argmax`` and ``scale_max`` (float32 ``[N]``, each output's largest
    ``|scale|``: ``screen_scales(scale)``) codes without mins are screened with x cut to one byte first, and
    only the outputs that could win are summed exactly: the same pick (cpu_q8.c)."""
    m, k, n = _shapes(x, torch.float32, packed, scale, block, bias, mins)
    if scale_max is not None:
        assert argmax and scale_max.shape == (n,) and scale_max.dtype == torch.float32
        assert scale_max.is_contiguous()
    y = torch.empty(m, dtype=torch.int64) if argmax else torch.empty((m, n), dtype=torch.float32)
    status = _lib().qgemv_q8_f32(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        scale.data_ptr(),
        0 if mins is None else mins.data_ptr(),
        block,
        0 if bias is None else bias.data_ptr(),
        0 if argmax else y.data_ptr(),
        n,
        m,
        n,
        k,
        y.data_ptr() if argmax else 0,
        0 if scale_max is None else scale_max.data_ptr(),
        limbs,
        torch.get_num_threads(),
    )
    _check(status)
    return y


def screen_scales(scale: torch.Tensor) -> torch.Tensor:
    """Each output's largest ``|scale|`` (float32 ``[N]``): what ``qgemv_f32``'s argmax screen bounds by."""
    return scale.abs().amax(1).float().contiguous()


def qgemv_bf16(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    mins: torch.Tensor | None = None,
    n_out: int | None = None,
) -> torch.Tensor:
    """bf16 ``x @ W.T (+ bias)`` for bf16 ``x [M, K]`` (unit inner stride, a few rows), ``W = q * scale`` per
    ``block`` inputs (``packed = pack(q, block)``, float32 ``scale [N, K / block]``), rounded to bf16 once.
    With ``activation`` the codes' rows are gate/up pairs and the result is ``act(gate) * up`` ``[M, N / 2]``
    in clib.gemm's GEMM_ACT_MUL roundings. x is cut to 2 bytes per input, as ``qgemv_f32``'s ``limbs=2``;
    ``mins`` as there, except where ``bf16_dots()``: then ``packed, scale, mins = pack4_tiles(q, ...)``, N is
    ``n_out`` (default: N padded to 16) and x is taken as it is (only float32's sums round before the
    result)."""
    if mins is not None and bf16_dots():
        m, k = x.shape
        n = scale.shape[0] * 16 if n_out is None else n_out
        assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and k % 64 == 0 and block == 32
        assert packed.dtype == torch.uint8 and packed.is_contiguous()
        assert packed.numel() * 2 == scale.shape[0] * 16 * k  # N padded to 16, two codes a byte
        assert scale.shape == mins.shape == (-(-n // 16), k // 32, 16) and scale.is_contiguous()
        assert mins.is_contiguous()
        assert bias is None or (bias.dtype == torch.bfloat16 and bias.shape == (n,))
    else:
        m, k, n = _shapes(x, torch.bfloat16, packed, scale, block, bias, mins)
    if activation is not None:
        assert bias is None and n % 2 == 0
        y = torch.empty((m, n // 2), dtype=torch.bfloat16)
        table, out = clib.activation_table(activation).data_ptr(), clib.GEMM_ACT_MUL
    else:
        y, table, out = torch.empty((m, n), dtype=torch.bfloat16), 0, clib.GEMM_BF16
    status = _lib().qgemv_q8_bf16(
        x.data_ptr(),
        x.stride(0),
        packed.data_ptr(),
        scale.data_ptr(),
        0 if mins is None else mins.data_ptr(),
        block,
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.shape[1],
        m,
        n,
        k,
        out,
        table,
        torch.get_num_threads(),
    )
    _check(status)
    return y


def _shapes(
    x: torch.Tensor,
    dtype: torch.dtype,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    bias: torch.Tensor | None,
    mins: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """(M, K, N) of a call, its tensors checked against what the kernels read."""
    m, k = x.shape
    n = packed.shape[0]
    assert x.dtype == dtype and x.stride(1) == 1 and k % 64 == 0 and block in BLOCKS
    assert packed.dtype == torch.uint8 and packed.is_contiguous()
    assert packed.shape[1] == (k if mins is None else k // 2)
    assert scale.dtype == torch.float32 and scale.shape == (n, k // block) and scale.is_contiguous()
    assert mins is None or (block == 32 and mins.dtype == torch.float32 and mins.shape == scale.shape)
    assert mins is None or mins.is_contiguous()
    assert bias is None or (bias.dtype == dtype and bias.shape == (n,) and bias.is_contiguous())
    return m, k, n


def _lib():  # type: ignore[no-untyped-def]
    lib = clib.load()
    assert lib is not None, "the CPU kernels are not built here"
    return lib


def _check(status: int) -> None:
    if status == -3:
        raise MemoryError("cpu_q8.c: no memory for the rows' scratch")
    assert status == 0, f"cpu_q8.c rejected the call ({status})"
