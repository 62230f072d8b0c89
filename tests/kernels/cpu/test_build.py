"""How the C kernels are compiled and loaded: the level's flags, the tuning, the cache key, and the fallbacks
(no compiler, a failing compiler, no OpenMP) that leave the torch path running with one warning."""

from __future__ import annotations

import logging
import os
import stat
import subprocess

import pytest

from aioengine.kernels.cpu import clib as cpu_kernels
from aioengine.kernels.cpu import isa


def _fake_gcc(monkeypatch, tune: str | None):
    def run(cmd, **kwargs):
        if tune is None:
            raise FileNotFoundError(cmd[0])
        assert cmd[1:] == ["-march=native", "-Q", "--help=target"]
        out = f"  -march=                     \t\t{tune}\n  -mtune=                     \t\t{tune}\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", run)


@pytest.mark.parametrize(
    ("tune", "level", "expected"),
    [
        (
            "znver3",
            "avx512-bf16",
            ["-mtune=sapphirerapids"],
        ),  # gcc 12 on Zen 4/5: tuned as Zen 3 (no AVX-512)
        ("znver2", "avx512", ["-mtune=sapphirerapids"]),
        ("znver3", "avx2", ["-mtune=native"]),  # the AVX2 build keeps the native tuning
        ("znver4", "avx512-bf16", ["-mtune=native"]),  # a compiler that knows the core keeps its own tuning
        ("sapphirerapids", "avx512", ["-mtune=native"]),
        (None, "avx2", []),  # no compiler answer: no extra flag
    ],
)
def test_tune_flags(monkeypatch, tune, level, expected):
    _fake_gcc(monkeypatch, tune)
    assert cpu_kernels._tune_flags("gcc", level) == expected


def _recording_compiler(monkeypatch, tune: list[str]) -> list[list[str]]:
    built: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        if cmd[1:2] == ["--version"]:
            return subprocess.CompletedProcess(cmd, 0, stdout="gcc 12\n", stderr="")
        if "--help=target" in cmd:
            return subprocess.CompletedProcess(cmd, 0, stdout=f"  -mtune=  \t{tune[0]}\n", stderr="")
        out = cmd[cmd.index("-o") + 1]
        built.append(cmd)
        open(out, "wb").close()
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", fake_run)
    return built


def test_the_level_and_the_tuning_are_part_of_the_builds_cache_key(monkeypatch, tmp_path):
    """A library built with other flags is not reused: the level and its flags go into the file name."""
    tune = ["znver3"]
    built = _recording_compiler(monkeypatch, tune)
    tuned = cpu_kernels.build("gcc", "avx512", tmp_path)
    assert any("-mtune=sapphirerapids" in cmd for cmd in built)
    assert all("-march=native" not in cmd for cmd in built)  # never more than the level's instructions
    tune[0] = "znver4"
    assert cpu_kernels.build("gcc", "avx512", tmp_path) != tuned
    avx2 = cpu_kernels.build("gcc", "avx2", tmp_path)
    assert avx2 != tuned and "-avx2-" in avx2.name
    assert any("-mavx2" in cmd and "-mavx512f" not in cmd for cmd in built[-len(cpu_kernels.SOURCES) - 1 :])


@pytest.fixture
def fresh_loader(monkeypatch):
    """The loader as a new process has it (restored after the test)."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    monkeypatch.setattr(cpu_kernels, "_level", None)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch, fresh_loader, caplog):
    monkeypatch.setattr(cpu_kernels.env, "c_compiler", lambda: None)
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
        assert cpu_kernels.load() is None  # decided once: no second try, no second line
    assert len(_warnings(caplog)) == 1 and "no C compiler" in _warnings(caplog)[0]
    assert "torch path" in _warnings(caplog)[0] and cpu_kernels.loaded_level() is None


def test_a_failing_compiler_falls_back_to_torch_with_one_warning(monkeypatch, fresh_loader, tmp_path, caplog):
    """gcc 10 does not know every flag a level needs; any failed compile ends the same way: torch, one
    line."""
    old = tmp_path / "gcc-10"
    old.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo 'gcc 10.2'; exit 0; }\n"
        "echo 'unknown option' >&2\nexit 1\n"
    )
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(cpu_kernels.env, "c_compiler", lambda: str(old))
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert len(_warnings(caplog)) == 1 and "unknown option" in _warnings(caplog)[0]


def test_a_level_this_cpu_cannot_run_is_refused_by_name(monkeypatch, fresh_loader):
    monkeypatch.setattr(
        isa, "cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "popcnt"})
    )
    monkeypatch.setattr(isa, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match="cpu_isa='avx512-bf16' needs CPU features.*it runs: avx2"):
        cpu_kernels.load("avx512-bf16")


def test_a_process_runs_one_level(fresh_loader):
    """The first load chooses; a later backend that names another level gets a clear error, not a mixed
    process."""
    levels = isa.runnable_levels()
    if len(levels) < 2 or cpu_kernels.env.c_compiler() is None:
        pytest.skip("needs a CPU that runs two kernel levels and a C compiler")
    assert cpu_kernels.load(levels[0]) is not None and cpu_kernels.loaded_level() == levels[0]
    assert cpu_kernels.load(levels[0]) is not None  # the same level again: fine
    with pytest.raises(ValueError, match="already chose"):
        cpu_kernels.load(levels[-1])


def test_without_openmp_the_kernels_build_single_threaded(tmp_path):
    """Apple's clang has no OpenMP: the sources build and link without it (cpu_omp.h answers as one
    thread)."""
    compiler = cpu_kernels.env.c_compiler()
    levels = isa.runnable_levels()
    if compiler is None or not levels:
        pytest.skip("needs a C compiler and a kernel level this CPU runs")
    lib = cpu_kernels.build(compiler, levels[0], tmp_path, openmp=False)
    out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
    assert "omp_" not in out and "GOMP" not in out
    assert os.path.getsize(lib) > 0
