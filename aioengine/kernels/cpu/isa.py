"""What this CPU can do, read once, and the ISA level its C kernels are built for (chosen once at start).

A level names the instructions a kernel library may use; a level is only ever built and loaded on a CPU whose
flags include every one it needs, so a library can never meet an instruction its CPU lacks (no SIGILL).
"""

from __future__ import annotations

import functools
import platform
import subprocess

from aioengine.config import CPU_ISA_LEVELS

# The CPU flags (as /proc/cpuinfo spells them) each level needs, and the compiler flags that build it. Spelled
# out rather than -march=x86-64-v3/v4, which gcc 10 does not know.
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "popcnt"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
_NEEDS: dict[str, frozenset[str]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512-bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},
    "neon": frozenset({"asimd"}),
}
_X86_AVX2 = ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mpopcnt"]
_X86_AVX512 = [*_X86_AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512cd"]
_MARCH: dict[str, list[str]] = {
    "avx2": _X86_AVX2,
    "avx512": _X86_AVX512,
    "avx512-bf16": [*_X86_AVX512, "-mavx512bf16", "-mavx512vnni"],
}
_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def machine() -> str:
    """``x86_64``, ``aarch64``, or what the platform calls any other architecture."""
    name = platform.machine().lower()
    return _ARCH.get(name, name)


def _level_arch(level: str) -> str:
    return "aarch64" if level == "neon" else "x86_64"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, spelled as Linux's /proc/cpuinfo spells them: read from there, else (macOS)
    from sysctl; empty where neither answers (then no kernel level is chosen but NEON on ARM64, which every
    ARMv8-A core has)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return _sysctl_flags()


def _sysctl_flags() -> frozenset[str]:
    if platform.system() != "Darwin":
        return frozenset()
    if machine() == "aarch64":  # Apple silicon: every M-series core has dotprod; i8mm from M2 on
        keys = {"hw.optional.arm.FEAT_DotProd": "asimddp", "hw.optional.arm.FEAT_I8MM": "i8mm"}
        found = {"asimd"}
        for key, flag in keys.items():
            if _sysctl(key).strip() == "1":
                found.add(flag)
        return frozenset(found)
    words = _sysctl("machdep.cpu.features machdep.cpu.leaf7_features").lower().split()
    return frozenset("avx" if w == "avx1.0" else w for w in words)  # else spelled as Linux spells them


def _sysctl(keys: str) -> str:
    try:
        return subprocess.run(
            ["sysctl", "-n", *keys.split()], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def runnable_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels this CPU runs, lowest first (an AVX512-BF16 CPU runs the AVX2 and AVX-512 builds too)."""
    flags = cpu_flags() if flags is None else flags
    arch = machine()
    if arch == "aarch64" and not flags:
        flags = frozenset({"asimd"})  # no flags to read (a container without /proc): NEON is ARMv8-A's own
    return [lvl for lvl in CPU_ISA_LEVELS if _level_arch(lvl) == arch and _NEEDS[lvl] <= flags]


def resolve_level(requested: str) -> str | None:
    """``auto``: the highest level this CPU runs (None: none, the torch path); a named level must be one this
    CPU runs, else ValueError naming those it does."""
    levels = runnable_levels()
    if requested == "auto":
        return levels[-1] if levels else None
    if requested not in levels:
        runs = ", ".join(levels) or "none of them"
        raise ValueError(f"cpu_isa={requested!r} needs CPU features this CPU lacks; it runs: {runs}")
    return requested


def compile_flags(level: str, flags: frozenset[str] | None = None) -> list[str]:
    """The compiler's target flags for ``level``, with the optional extensions ``flags`` (the target CPU's)
    has: AVX-VNNI on an AVX2 core; dotprod and i8mm on ARM64."""
    flags = cpu_flags() if flags is None else flags
    if level == "neon":
        ext = "".join(
            f"+{name}" for flag, name in (("asimddp", "dotprod"), ("i8mm", "i8mm")) if flag in flags
        )
        return [f"-march=armv8.2-a{ext}" if ext else "-march=armv8-a"]
    extra = ["-mavxvnni"] if level == "avx2" and "avx_vnni" in flags else []
    return [*_MARCH[level], *extra]


def level_has_fast_bf16(level: str | None) -> bool:
    """Whether bf16 matmuls beat float32 at this level: only at avx512-bf16 (every AMX CPU has it too)."""
    return level == "avx512-bf16"
