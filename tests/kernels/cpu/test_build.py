"""How the C kernels are compiled: the tuning flag added where gcc does not know the CPU."""

from __future__ import annotations

import subprocess

import pytest

from aioengine.kernels.cpu import clib as cpu_kernels


def _fake_gcc(monkeypatch, tune: str | None, cpu_flags: str = "flags : fpu sse2 avx2 avx512f avx512_bf16"):
    def run(cmd, **kwargs):
        if tune is None:
            raise FileNotFoundError(cmd[0])
        assert cmd[1:] == ["-march=native", "-Q", "--help=target"]
        out = f"  -march=                     \t\t{tune}\n  -mtune=                     \t\t{tune}\n"
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", run)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: cpu_flags)


@pytest.mark.parametrize(
    ("tune", "cpu_flags", "expected"),
    [
        (
            "znver3",
            None,
            ["-mtune=sapphirerapids"],
        ),  # gcc 12 on Zen 4/5: tuned as Zen 3, which has no AVX-512
        ("znver2", None, ["-mtune=sapphirerapids"]),
        ("znver4", None, []),  # a compiler that knows the core keeps its own tuning
        ("sapphirerapids", None, []),
        ("znver3", "flags : fpu sse2 avx2", []),  # a real Zen 3: no AVX-512, nothing to retune
        (None, None, []),  # no compiler answer: no extra flag
    ],
)
def test_tune_flags(monkeypatch, tune, cpu_flags, expected):
    _fake_gcc(monkeypatch, tune, *([cpu_flags] if cpu_flags else []))
    assert cpu_kernels._tune_flags("gcc") == expected


def test_the_tuning_is_part_of_the_builds_cache_key(monkeypatch, tmp_path):
    """A library built with other flags is not reused: the flags go into the file name's hash."""
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    built = []

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
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : avx512f")
    tune = ["znver3"]
    tuned = cpu_kernels._build("gcc")
    assert any("-mtune=sapphirerapids" in cmd for cmd in built)
    tune[0] = "znver4"
    assert cpu_kernels._build("gcc") != tuned
