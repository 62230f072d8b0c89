"""The kernels' ISA levels: which a CPU runs, the flags each is built with (never an instruction the CPU
lacks), the level the loaded library reports, and the kernel tests run against every level this machine
has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aioengine.kernels.cpu import clib, isa

ZEN3 = frozenset(
    [
        "fpu",
        "sse",
        "sse2",
        "ssse3",
        "sse4_1",
        "sse4_2",
        "avx",
        "avx2",
        "fma",
        "f16c",
        "bmi1",
        "bmi2",
        "popcnt",
        "aes",
        "sha_ni",
        "vaes",
        "vpclmulqdq",
    ]
)
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512_bf16", "avx512_vnni"}
SKYLAKE_X = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
ALDER_LAKE = ZEN3 | {"avx_vnni"}
# -m flag -> the /proc/cpuinfo flag it needs
_NEEDS = {
    "-mavx": "avx",
    "-mavx2": "avx2",
    "-mfma": "fma",
    "-mf16c": "f16c",
    "-mbmi": "bmi1",
    "-mbmi2": "bmi2",
    "-mpopcnt": "popcnt",
    "-mavx512f": "avx512f",
    "-mavx512bw": "avx512bw",
    "-mavx512dq": "avx512dq",
    "-mavx512vl": "avx512vl",
    "-mavx512cd": "avx512cd",
    "-mavx512bf16": "avx512_bf16",
    "-mavx512vnni": "avx512_vnni",
    "-mavxvnni": "avx_vnni",
}


@pytest.mark.parametrize(
    ("arch", "flags", "levels"),
    [
        ("x86_64", ZEN3, ["avx2"]),
        ("x86_64", ALDER_LAKE, ["avx2"]),
        ("x86_64", SKYLAKE_X, ["avx2", "avx512"]),
        ("x86_64", ZEN4, ["avx2", "avx512", "avx512-bf16"]),
        ("x86_64", frozenset({"sse2", "avx"}), []),  # Sandy Bridge: no level, the torch path
        ("x86_64", frozenset(), []),  # no flags to read: nothing is assumed
        ("aarch64", frozenset({"fp", "asimd", "asimddp"}), ["neon"]),
        ("aarch64", frozenset(), ["neon"]),  # no /proc/cpuinfo (a container, macOS): NEON is ARMv8-A's own
        ("riscv64", frozenset({"rv64imafdc"}), []),
    ],
)
def test_the_levels_a_cpu_runs(monkeypatch, arch, flags, levels):
    monkeypatch.setattr(isa, "machine", lambda: arch)
    assert isa.runnable_levels(flags) == levels
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    assert isa.resolve_level("auto") == (levels[-1] if levels else None)


@pytest.mark.parametrize("flags", [ZEN3, ALDER_LAKE, SKYLAKE_X, ZEN4])
def test_a_level_is_built_only_with_instructions_the_cpu_has(monkeypatch, flags):
    """SIGILL impossible by construction: every target flag of every level this CPU runs names a feature the
    CPU reports (AVX-VNNI only where it has it), and never -march=native."""
    monkeypatch.setattr(isa, "machine", lambda: "x86_64")
    for level in isa.runnable_levels(flags):
        target = isa.compile_flags(level, flags)
        assert all(f in _NEEDS for f in target), target
        assert {_NEEDS[f] for f in target} <= flags
    assert ("-mavxvnni" in isa.compile_flags("avx2", flags)) == ("avx_vnni" in flags)


def test_neon_flags_follow_the_cores_extensions():
    assert isa.compile_flags("neon", frozenset({"asimd"})) == ["-march=armv8-a"]
    assert isa.compile_flags("neon", frozenset({"asimd", "asimddp"})) == ["-march=armv8.2-a+dotprod"]
    assert isa.compile_flags("neon", frozenset({"asimd", "asimddp", "i8mm"})) == [
        "-march=armv8.2-a+dotprod+i8mm"
    ]


needs_kernels = pytest.mark.skipif(
    clib.env.c_compiler() is None or not isa.runnable_levels(), reason="no C compiler or no kernel level here"
)


@needs_kernels
def test_the_loaded_library_is_a_level_this_cpu_runs():
    """The library states the level it was compiled for (cpu_isa.c, from the compiler's macros): it is the
    level asked for, and one whose every feature this CPU reports."""
    lib = clib.load()
    assert lib is not None, "a compiler and a level are here: the kernels must build"
    level = clib.loaded_level()
    assert level in isa.runnable_levels()
    assert clib._LEVEL_CODES[lib.aioengine_isa_level()] == level
    assert {_NEEDS[f] for f in isa.compile_flags(level) if f in _NEEDS} <= isa.cpu_flags()


def _pytest_at_level(level: str, pytestconfig, paths: list[str], deselect: str) -> None:
    """Run ``paths`` against exactly ``level``'s library, in a process of its own (a process runs one level).
    The level this process loaded ran them already, in the suite itself."""
    if level not in isa.runnable_levels():
        pytest.skip(f"this CPU does not run {level}")
    assert not pytestconfig.getoption("--cpu-isa"), "a run for one level never starts the others"
    if level == clib.loaded_level():
        pytest.skip(f"{level} is this process's own level: the suite ran these tests against it")
    root = Path(__file__).parents[3]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, "--cpu-isa", level,
         "-k", f"not ({deselect})", "-x", "-n", "0"],
        capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


LEVELS = ["avx2", "avx512", "avx512-bf16"]


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
def test_the_kernel_tests_pass_at_each_level_this_machine_runs(level, pytestconfig):
    """The same kernel tests, each against the torch reference (and the decode attention's cut into runs,
    which the levels without AVX512-BF16 also run for bf16)."""
    # Not the tests that load no level's library: the NEON build under qemu, the build without OpenMP and the
    # AVX-VNNI build check (they ran once, in the suite).
    _pytest_at_level(
        level,
        pytestconfig,
        [
            "tests/kernels/cpu",
            "tests/kernels/test_attention.py::test_c_decode_kernel_cuts_long_sequences_into_runs",
            "--ignore=tests/kernels/cpu/test_neon_qemu.py",
            "--ignore=tests/kernels/cpu/test_build.py",
        ],
        "at_each_level or avx_vnni_dots",
    )


@needs_kernels
@pytest.mark.parametrize("level", LEVELS)
def test_greedy_parity_with_transformers_at_each_level_this_machine_runs(level, pytestconfig):
    """The parity configs (chunked, prefix hits, preemption; each architecture), the default model through
    its Q4_1 codes and a Q4_K mixture's experts on theirs: greedy tokens equal transformers' at every level;
    the decode stack gives the Python path's bits at every level (float32 where bf16 has no dots), and the
    linears on codes and the int4 rows take the kernels each level prefers."""
    paths = [
        "tests/engine/test_parity.py",
        "tests/engine/test_default_model_codes.py",
        "tests/engine/test_q8_head.py",
        "tests/gpu/cpu/test_decode_stack.py",
        "tests/gpu/cpu/test_q8_linear.py",
        "tests/engine/test_quant.py",
        "tests/gpu/cpu/test_coded_experts.py",
    ]
    # A GGUF mixture's experts run the level's kernels on their codes (test_coded_experts.py); the mixtures
    # from float checkpoints run the torch reference's experts: the suite's own run covers them.
    _pytest_at_level(level, pytestconfig, paths, "at_each_level or moe or mixtral")


@needs_kernels
def test_the_avx2_level_builds_its_avx_vnni_dots(tmp_path):
    """Alder Lake and Zen 5 cores have AVX-VNNI: the avx2 level builds vpdpbusd for them (compiled here, not
    run: this CPU may lack it), and the build without it takes maddubs instead."""
    compiler = clib.env.c_compiler()
    if isa.machine() != "x86_64":
        pytest.skip("an x86-64 compiler builds the AVX2 level")
    vnni = clib.build(compiler, "avx2", tmp_path, cpu_flags=ALDER_LAKE)
    plain = clib.build(compiler, "avx2", tmp_path, cpu_flags=ZEN3)
    dump = {
        lib: subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
        for lib in (vnni, plain)
    }
    assert "vpdpbusd" in dump[vnni] and "vpdpbusd" not in dump[plain]
    assert "vpmaddubsw" in dump[plain]
    assert "zmm" not in dump[vnni] and "zmm" not in dump[plain]  # no AVX-512 register anywhere at this level
