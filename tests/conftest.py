"""Session-wide test setup: Triton runs under its CPU interpreter when no GPU is present, and --cpu-isa.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
(or a library such as xgrammar) can import a kernel module.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    # The kernel tests of one ISA level: `pytest tests/kernels/cpu --cpu-isa avx2` runs them against exactly
    # that level's library (tests/kernels/cpu/test_isa.py runs each level the machine has this way).
    parser.addoption("--cpu-isa", default=None, help="load the CPU kernels of this ISA level first")


def pytest_configure(config):
    level = config.getoption("--cpu-isa")
    if level:
        from aioengine.kernels.cpu import clib

        if clib.load(level) is None:
            raise RuntimeError(f"the {level} kernels did not build here")
