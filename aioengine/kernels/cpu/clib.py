"""The CPU's C kernels (cpu_decode_attention.c, cpu_prefill_attention.c, cpu_elementwise.c, cpu_gemm.c,
cpu_decode_stack.c, cpu_qgemv.c, cpu_q8.c, cpu_q4_bf16.c, cpu_q4_f32.c): built once per machine and ISA
level with the C compiler into one library, loaded with ctypes, and called on the worker thread (ctypes
releases the GIL).

The level (kernels/cpu/isa.py) is chosen once per process, by the first backend that loads it: its flags are
only ever ones this CPU has, and the library states the level it was compiled for, which the loader checks.
Built into the cache directory's ``kernels/`` (``aioengine.env.cache_dir``) under a name that hashes the
sources, the compiler, the level and its flags; the CPU backend starts the build on a thread when it is made.
It links libgomp, which resolves to the copy torch has already loaded, so the kernel and torch's ops share one
OpenMP thread pool; a compiler without OpenMP builds single-threaded kernels. No compiler, a compiler too old
for the level's flags, or a failed build: one warning, and the torch path runs instead (a backend told
``KernelConfig.cpu_kernels=False`` never loads it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from aioengine import env
from aioengine.kernels.cpu import isa

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "cpu_decode_attention.c",
        "cpu_prefill_attention.c",
        "cpu_elementwise.c",
        "cpu_gemm.c",
        "cpu_decode_stack.c",
        "cpu_qgemv.c",
        "cpu_q8.c",
        "cpu_q4_bf16.c",
        "cpu_q4_f32.c",
        "cpu_isa.c",
    )
]
# Included by the sources: part of the build's hash.
_HEADERS = [
    Path(__file__).with_name(n)
    for n in ("cpu_bf16.h", "cpu_avx512.h", "cpu_kernels.h", "cpu_omp.h", "cpu_q8_dot.h")
]
_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-std=c11"]  # compile only; the level's target flags are added
# Linked without -ffast-math: with it, gcc < 13 adds crtfastmath.o even to a shared library, whose
# constructor turns on flush-to-zero for the thread that loads it (a process-wide change of float results).
_LINK_FLAGS = ["-shared"]
# aioengine_isa_level()'s answers (cpu_isa.c)
_LEVEL_CODES = {1: "avx2", 2: "avx512", 3: "avx512-bf16", 4: "neon"}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_level: str | None = None  # the level loaded, or tried (with _failed)
_failed = False
_FUNCS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


def _cache_dir() -> Path:
    return env.cache_dir() / "kernels"


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)


def _tune_flags(compiler: str, level: str) -> list[str]:
    """Tuning for this CPU (never new instructions: -mtune only). ``-mtune=sapphirerapids`` where the
    compiler's native tuning is for an AMD core without AVX-512 (znver1-3) at an AVX-512 level: gcc 12 does
    not know Zen 4/5 and tunes them as Zen 3. Tuned for a core with AVX-512, the same kernels (same bits) ran
    the offline bench faster on a Zen 5."""
    try:
        target = subprocess.run(
            [compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    tune = next((line.split()[-1] for line in target.splitlines() if line.strip().startswith("-mtune=")), "")
    if level.startswith("avx512") and tune in ("znver1", "znver2", "znver3"):
        return ["-mtune=sapphirerapids"]
    return ["-mtune=native"] if tune else []


@functools.cache
def openmp_flags(compiler: str) -> tuple[str, ...]:
    """``("-fopenmp",)`` where ``compiler`` builds and links an OpenMP library, else none."""
    with tempfile.TemporaryDirectory() as work:
        src = Path(work) / "probe.c"
        src.write_text("#include <omp.h>\nint probe(void) { return omp_get_max_threads(); }\n")
        try:
            _run([compiler, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(Path(work) / "probe.so")])
        except (OSError, subprocess.SubprocessError):
            logger.info("%s has no OpenMP: the CPU kernels run on one thread", compiler)
            return ()
    return ("-fopenmp",)


def build(
    compiler: str,
    level: str,
    out_dir: Path,
    cpu_flags: frozenset[str] | None = None,
    extra: tuple[Path, ...] = (),
    executable: bool = False,
    openmp: bool = True,
) -> Path:
    """Compile the kernels for ``level`` (with the optional extensions ``cpu_flags`` has, by default this
    CPU's) into ``out_dir``: a shared library, or with ``executable`` a static program of the kernels and the
    ``extra`` sources (a cross-built test harness). A library already built from the same inputs is reused."""
    version = _run([compiler, "--version"]).stdout
    native = cpu_flags is None and not executable
    omp = list(openmp_flags(compiler)) if openmp else []
    flags = [
        *_FLAGS,
        *omp,
        *isa.compile_flags(level, cpu_flags),
        *(_tune_flags(compiler, level) if native else []),
    ]
    link = ["-static", *omp] if executable else [*_LINK_FLAGS, *omp]
    sources = [*SOURCES, *extra]
    key = hashlib.sha256(
        "\0".join([*(p.read_text() for p in sources + _HEADERS), version, level, *flags, *link]).encode()
    ).hexdigest()
    target = out_dir / (f"cpu_kernels-{level}-{key[:16]}" + ("" if executable else ".so"))
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        objects = [str(Path(work) / f"{src.stem}.o") for src in sources]
        for src, obj in zip(sources, objects, strict=True):
            _run([compiler, *flags, f"-I{Path(__file__).parent}", "-c", str(src), "-o", obj])
        tmp = str(Path(work) / "out")
        _run([compiler, *link, *objects, "-o", tmp, "-lm"])
        os.replace(tmp, target)  # atomic: a concurrent builder finds a whole file or none
    return target


def loaded_level() -> str | None:
    """The ISA level of the library this process loaded (None: none loaded)."""
    return _level if _lib is not None else None


def load(cpu_isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel library, building it on first use; None when it cannot be built or run here.
    ``cpu_isa`` (a KernelConfig.cpu_isa) picks the level on the process's first load; a later call naming
    another level raises ValueError (one library a process: the first backend chose it)."""
    global _lib, _failed, _level
    if _lib is not None or _failed:
        check_level(cpu_isa)
        return _lib
    with _lock:
        if _lib is not None or _failed:
            check_level(cpu_isa)
            return _lib
        level = isa.resolve_level(cpu_isa or "auto")  # ValueError for a level this CPU cannot run
        _level = level
        compiler = env.c_compiler()
        try:
            if level is None:
                raise OSError(f"no kernel ISA level runs on this CPU ({isa.machine()})")
            if compiler is None:
                raise FileNotFoundError("no C compiler (gcc or cc) on PATH")
            lib = ctypes.CDLL(str(build(compiler, level, _cache_dir())))
            lib.aioengine_isa_level.restype = ctypes.c_int
            built = _LEVEL_CODES.get(lib.aioengine_isa_level())
            if built != level:  # a compiler that ignored the level's flags: never run it as that level
                raise OSError(f"the library built for {level} reports {built}")
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", "") or "").strip().splitlines()
            logger.warning(
                "CPU C kernels unavailable (%s%s); using the torch path",
                e,
                f": {detail[-1]}" if detail else "",
            )
            _failed = True
            return None
        for name in (*_FUNCS.values(), "decode_attention_bf16_generic"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_float,
                ctypes.c_int,  # window (0: none)
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_int,
            ]
        lib.decode_attention_bf16_vectorized.restype = ctypes.c_int
        lib.decode_attention_bf16_vectorized.argtypes = []
        lib.exp_f32.restype = ctypes.c_int
        lib.exp_f32.argtypes = [_P, _P, _I64]
        for name, argtypes in _ELEMENTWISE.items():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = argtypes
        lib.prefill_attention_bf16.restype = ctypes.c_int
        lib.prefill_attention_bf16.argtypes = _PREFILL_ARGS
        lib.gemm_bf16_vectorized.restype = ctypes.c_int
        lib.gemm_bf16_vectorized.argtypes = []
        lib.packed_gemm_weight_elems.restype = ctypes.c_int64
        lib.packed_gemm_weight_elems.argtypes = [_I64, _I64]
        lib.pack_gemm_weight_bf16.restype = None
        lib.pack_gemm_weight_bf16.argtypes = [_P, _I64, _I64, _I, _P, _I]
        for name in ("decode_stack_bf16", "decode_stack_f32"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [_P, _I, _P, _P, _P]
        lib.qgemv_int8_f32.restype = None
        lib.qgemv_int8_f32.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
        lib.qgemv_q8_f32.restype = ctypes.c_int
        lib.qgemv_q8_f32.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _I]
        lib.qgemv_q8_f32.argtypes += [_I]
        lib.qgemv_q8_vectorized.restype = ctypes.c_int
        lib.qgemv_q8_vectorized.argtypes = []
        lib.q4t_available.restype = ctypes.c_int
        lib.q4t_available.argtypes = []
        lib.q4f_preferred.restype = ctypes.c_int
        lib.q4f_preferred.argtypes = []
        lib.q4f_pack.restype = None
        lib.q4f_pack.argtypes = [_P, _P, _I64, _I64, _I]
        lib.q4f_gemv_f32.restype = ctypes.c_int
        lib.q4f_gemv_f32.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
        lib.q8f_pack.restype = None
        lib.q8f_pack.argtypes = [_P, _P, _I64, _I64, _I]
        lib.q8f_gemv_f32.restype = ctypes.c_int
        lib.q8f_gemv_f32.argtypes = [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
        lib.moe_q4f_f32.restype = ctypes.c_int
        lib.moe_q4f_f32.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _I]
        lib.q4t_pack.restype = None
        lib.q4t_pack.argtypes = [_P, _P, _I64, _I64, _I]
        lib.q8_pack.restype = None
        lib.q8_pack.argtypes = [_P, _P, _I64, _I64, _I64, _I]
        lib.q4_pack.restype = None
        lib.q4_pack.argtypes = [_P, _P, _I64, _I64, _I]
        lib.qgemv_q8_bf16.restype = ctypes.c_int
        lib.qgemv_q8_bf16.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I, _P, _I]
        lib.gemm_bf16.restype = ctypes.c_int
        lib.gemm_bf16.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I, _P, _I]
        _lib = lib
        logger.info("CPU C kernels: the %s level", level)
        return lib


def check_level(cpu_isa: str | None) -> None:
    """ValueError where this process already loaded (or failed to build) another level than ``cpu_isa``
    names; "auto" and None take whatever it runs."""
    if cpu_isa is None or cpu_isa == "auto" or (_lib is None and not _failed):
        return
    want = isa.resolve_level(cpu_isa)
    if want != _level:
        raise ValueError(
            f"cpu_isa={cpu_isa!r}: this process already chose the CPU kernels' level "
            f"({_level or 'none'}{'' if _lib is not None else ', whose build failed: the torch path'}); "
            "one level runs a process"
        )


_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_ELEMENTWISE = {
    "add_rms_norm_bf16": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F, _I],
    "gemma_rms_norm_bf16": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _I],
    "rotary_bf16": [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I],
    "add_rms_norm_f32": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F, _I],
    "rotary_f32": [_P, _I64, _P, _P, _P, _P, _I64, _I64, _I64, _I],
    "silu_and_mul_f32": [_P, _I64, _P, _I64, _I64, _I64, _I],
    "argmax_bf16": [_P, _I64, _I64, _I64, _P, _I],
    "store_kv_cpu": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I, _I, _I, _I64, _I64, _I64, _I, _I64],
}
_PREFILL_ARGS: list[type[ctypes._SimpleCData[Any]]]  # declared: mypy infers type[_CData], too wide
_PREFILL_ARGS = [_P, _I64, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _F, _I, _I64, _I64, _I64, _I]


def cache_pointers(kv_cache: torch.Tensor) -> tuple[int, int]:
    """The key and value base addresses of one layer's cache ``[2, blocks, ...]`` (any strides)."""
    return kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.stride(0) * kv_cache.element_size()


_ELEMENTWISE_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def elementwise_ok(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """Whether the fused elementwise kernels take ``x`` (``dtypes`` on the CPU, rows with unit inner stride;
    the norm and rotary also have float32 versions, the argmax has not)."""
    return (
        x.dtype in dtypes
        and x.device.type == "cpu"
        and x.dim() >= 2
        and x.stride(-1) == 1
        and load() is not None
    )


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) * weight, x + residual)``; with ``x`` None, ``(rms_norm(residual) * weight,
    residual)``. 2-D bf16 or float32 ``[rows, hidden]``, rows may be strided."""
    rows, hidden = residual.shape
    out = torch.empty((rows, hidden), dtype=residual.dtype)
    new_residual = residual if x is None else torch.empty((rows, hidden), dtype=residual.dtype)
    weight = weight.contiguous()
    assert weight.dtype == residual.dtype and (x is None or x.dtype == residual.dtype)
    getattr(_lib, f"add_rms_norm_{_ELEMENTWISE_DTYPES[residual.dtype]}")(
        0 if x is None else x.data_ptr(),
        0 if x is None else x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        new_residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out, new_residual


def gemma_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's ``norm(r) * (1 + weight)`` (one rounding) of ``r = x + residual`` (or ``residual`` alone when
    ``x`` is None), with ``r``; bf16. ``residual`` is ``[rows, hidden]`` (rows may be strided) or, with
    ``x`` None, ``[tokens, heads, hidden]`` with contiguous heads (q/k norms: each head alone)."""
    heads = 1 if residual.dim() == 2 else residual.shape[1]
    rows, hidden = residual.shape[0], residual.shape[-1]
    assert residual.stride(-1) == 1 and (heads == 1 or (x is None and residual.stride(1) == hidden))
    out = torch.empty(residual.shape, dtype=residual.dtype)
    new_residual = residual if x is None else torch.empty((rows, hidden), dtype=residual.dtype)
    weight = weight.contiguous()
    assert weight.dtype == residual.dtype == torch.bfloat16 and (x is None or x.dtype == residual.dtype)
    assert _lib is not None  # loaded: the callers check first
    _lib.gemma_rms_norm_bf16(
        0 if x is None else x.data_ptr(),
        0 if x is None else x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        new_residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        heads * hidden,
        rows,
        heads,
        hidden,
        eps,
        torch.get_num_threads(),
    )
    return out, new_residual


def silu_and_mul_f32(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for float32 ``x [rows, 2d]`` (rows may be strided): contiguous
    ``[rows, d]``, the bits decode_stack_f32 computes."""
    rows, d = x.shape[0], x.shape[1] // 2
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == 2 * d
    out = torch.empty((rows, d), dtype=torch.float32)
    assert _lib is not None  # loaded: the callers check first
    _lib.silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), d, rows, d, torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (heads contiguous within a token, any token stride) by ``positions`` with the
    full-width tables ``[max_position, D]``; returns a contiguous ``[T, H, D]``."""
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim and cos2.is_contiguous() and sin2.is_contiguous()
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    assert cos2.dtype == sin2.dtype == x.dtype
    getattr(_lib, f"rotary_{_ELEMENTWISE_DTYPES[x.dtype]}")(
        x.data_ptr(),
        x.stride(0),
        positions.data_ptr(),
        cos2.data_ptr(),
        sin2.data_ptr(),
        out.data_ptr(),
        tokens,
        heads,
        head_dim,
        torch.get_num_threads(),
    )
    return out


def gemm_available() -> bool:
    """Whether the AVX512-BF16 GEMM of cpu_gemm.c is built here (else bf16 linears keep oneDNN)."""
    lib = load()
    return lib is not None and bool(lib.gemm_bf16_vectorized())


# gemm's epilogues (cpu_kernels.h's OUT_*)
GEMM_BF16, GEMM_F32, GEMM_ACT_MUL, GEMM_ARGMAX = 0, 1, 2, 3


def packed_gemm_weight_elems(n: int, k: int) -> int:
    """The bf16 elements of an ``[n, k]`` weight in gemm's panel layout."""
    assert gemm_available(), "cpu_gemm.c is not built for this CPU"
    assert _lib is not None  # loaded: the callers check first
    return _lib.packed_gemm_weight_elems(n, k)


def pack_gemm_weight(
    weight: torch.Tensor, gated: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """A bf16 ``[N, K]`` weight in gemm's panel layout (a flat bf16 tensor, written into ``out`` if given).
    ``gated``: a fused gate_up weight (gate rows, then up rows; N a multiple of 64) laid out for the
    GEMM_ACT_MUL epilogue."""
    n, k = weight.shape
    assert not gated or n % 64 == 0
    numel = packed_gemm_weight_elems(n, k)
    weight = weight.detach().contiguous()
    packed = torch.empty(numel, dtype=torch.bfloat16) if out is None else out
    assert packed.dtype == torch.bfloat16 and packed.shape == (numel,) and packed.is_contiguous()
    assert _lib is not None  # loaded: the callers check first
    _lib.pack_gemm_weight_bf16(weight.data_ptr(), n, k, gated, packed.data_ptr(), torch.get_num_threads())
    return packed


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}
GATED_ACTIVATIONS = tuple(_ACTIVATIONS)  # what GEMM_ACT_MUL's epilogue can apply to the gate


@functools.cache
def activation_table(name: str) -> torch.Tensor:
    """torch's activation ``name`` of every bf16 value (by bit pattern), as float32: the epilogue looks its
    bits up, so they are torch's whatever exp or tanh it uses (a float32 silu on a bf16 tie rounds by the
    last bit of exp)."""
    every_bf16 = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    return _ACTIVATIONS[name](every_bf16).float()


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    epilogue: int = GEMM_BF16,
    activation: str | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias)`` with ``W [N, K]`` packed by ``pack_gemm_weight``; ``x``'s rows may be
    strided (unit inner stride). Returns bf16 ``[M, N]``; with GEMM_F32 float32 ``[M, N]`` (the sums
    unrounded); with GEMM_ACT_MUL (a gated weight, no bias) bf16 ``[M, N / 2]``: activation(gate) * up,
    rounded as torch rounds; with GEMM_ARGMAX int64 ``[M]``: ``argmax`` of the float32 row, as torch picks it
    (first maximum; NaN wins)."""
    m, k = x.shape
    assert _lib is not None  # loaded: the callers check first
    assert (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and packed.numel() == _lib.packed_gemm_weight_elems(out_features, k)
    )
    assert (epilogue == GEMM_ACT_MUL) == (activation is not None), "an activation goes with GEMM_ACT_MUL"
    width = out_features // 2 if epilogue == GEMM_ACT_MUL else out_features
    if epilogue == GEMM_ARGMAX:
        out = torch.empty(m, dtype=torch.int64)
    else:
        out = torch.empty((m, width), dtype=torch.float32 if epilogue == GEMM_F32 else torch.bfloat16)
    if m:
        status = _lib.gemm_bf16(
            x.data_ptr(),
            x.stride(0),
            packed.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            out.data_ptr(),
            width,
            m,
            out_features,
            k,
            epilogue,
            activation_table(activation).data_ptr() if activation is not None else 0,
            torch.get_num_threads(),
        )
        if status == -3:
            raise MemoryError("gemm_bf16: no memory for the argmax's partial results")
        assert status == 0, f"gemm_bf16 rejected the call ({status})"
    return out


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (else the caller runs the torch path)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    return (
        query.dtype in _FUNCS
        and kv_cache.dtype == query.dtype
        and query.device.type == "cpu"
        and head_dim <= 256
        and num_heads // num_kv_heads <= 16
        and block_size <= 64
        and query.stride(2) == 1
        and query.stride(1) == head_dim
        and kv_cache.stride(4) == 1
    )


def qgemv_int8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (q * scale[:, None]).T + bias`` for float32 ``x [M, K]`` (unit inner stride, a few rows) and int8
    ``q [N, K]`` (contiguous) with float32 ``scale [N]``; float32 ``[M, N]``."""
    m, k = x.shape
    n = q.shape[0]
    assert x.dtype == torch.float32 and x.stride(1) == 1 and q.dtype == torch.int8 and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.is_contiguous() and q.shape[1] == k
    y = torch.empty((m, n), dtype=torch.float32)
    assert _lib is not None  # loaded: the callers check first
    _lib.qgemv_int8_f32(
        x.data_ptr(),
        x.stride(0),
        q.data_ptr(),
        scale.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64) for 2-D bf16 ``x`` with unit inner stride, the same indices (ties and NaNs
    included) without widening the rows to float32."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    assert _lib is not None  # loaded: the callers check first
    _lib.argmax_bf16(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr(), torch.get_num_threads())
    return out


def store_ok(key: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether store_kv takes these (CPU tensors of one dtype, rows of D contiguous elements)."""
    return (
        kv_cache.device.type == "cpu"
        and key.dtype == kv_cache.dtype
        and key.stride(-1) == 1
        and key.stride(-2) == key.shape[-1]
        and kv_cache.stride(4) == 1
        and load() is not None
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the cache slots ``slot_mapping`` ``[T]``; a slot outside
    the cache (-1: a padded row) is skipped, never written out of bounds."""
    assert value.stride(-1) == 1 and value.stride(-2) == value.shape[-1] and value.dtype == key.dtype
    slots = (
        slot_mapping
        if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        else slot_mapping.to(torch.int64).contiguous()
    )
    assert _lib is not None  # loaded: the callers check first
    _lib.store_kv_cpu(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        *cache_pointers(kv_cache),
        slots.data_ptr(),
        slots.shape[0],
        kv_cache.shape[3],
        kv_cache.shape[4],
        kv_cache.shape[2],
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_cache.element_size(),
        kv_cache.shape[1] * kv_cache.shape[2],
    )


def fast_prefill(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether a batch with prompt chunks takes the C kernels (prompt chunks through prefill_attention,
    decodes through decode_attention): bf16 on the AVX512-BF16 build, head_dim a multiple of 32, shapes
    `supports` takes. Even one row per query token beats gather + SDPA for bf16, short prompts and long
    contexts alike; for float32 SDPA's GEMMs win, so float32 keeps them."""
    lib = load()
    return (
        lib is not None
        and query.dtype == torch.bfloat16
        and query.shape[2] % 32 == 0
        and bool(lib.decode_attention_bf16_vectorized())
        and supports(query, kv_cache)
    )


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """query ``[B, Hq, D]`` (one token per request) -> ``[B, Hq, D]`` over each request's blocks (only
    the last ``window`` positions of each, for a sliding-window layer)."""
    lib = load()
    assert lib is not None and supports(query, kv_cache)
    num_reqs, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    block_table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    assert block_table.stride(1) == 1 and seq_lens.is_contiguous()
    out = torch.empty((num_reqs, num_heads, head_dim), dtype=query.dtype)
    status = getattr(lib, _FUNCS[query.dtype])(
        query.data_ptr(),
        query.stride(0),
        *cache_pointers(kv_cache),
        block_table.data_ptr(),
        block_table.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window or 0,
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        torch.get_num_threads(),
    )
    if status == -3:
        raise MemoryError("decode attention: no memory for the runs' partial states")
    assert status == 0, "kernel rejected the shapes"
    return out


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One request's chunk: query ``[q_len, Hq, D]`` (its last token at position ``seq_len - 1``) over the
    blocks ``blocks`` (int32, the request's block-table row) -> ``[q_len, Hq, D]``; with ``window``, each
    token sees only itself and the ``window - 1`` positions before it."""
    q_len, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert query.stride(2) == 1 and query.stride(1) == head_dim and kv_cache.stride(4) == 1
    blocks = (
        blocks
        if blocks.dtype == torch.int32 and blocks.is_contiguous()
        else blocks.to(torch.int32).contiguous()
    )
    out = torch.empty((q_len, num_heads, head_dim), dtype=query.dtype)
    lib = load()
    assert lib is not None
    status = lib.prefill_attention_bf16(
        query.data_ptr(),
        query.stride(0),
        *cache_pointers(kv_cache),
        blocks.data_ptr(),
        q_len,
        seq_len,
        out.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window or 0,
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("prefill attention: no memory for the packed keys and values")
    assert status == 0, f"prefill kernel rejected the shapes ({status})"
    return out
