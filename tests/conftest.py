"""Session-wide test setup: each xdist worker's own cores, Triton's CPU interpreter when no GPU is present,
and --cpu-isa.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
(or a library such as xgrammar) can import a kernel module.
"""

import os
import shutil

# xdist workers that each run torch's and the kernels' OpenMP threads over every core spin against each other
# and slow the suite badly: each worker gets its own share of the cores, and the engines it starts size their
# threads to it. Tests of thread counts set them explicitly; the serial part has every core.
_worker = os.environ.get("PYTEST_XDIST_WORKER")
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _worker and _workers > 1 and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    _i = int(_worker.removeprefix("gw"))
    os.sched_setaffinity(0, _cores[_i::_workers] if _workers <= len(_cores) else [_cores[_i % len(_cores)]])

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The Ray clusters the tests start (and their `serve run` children) report nothing anywhere.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


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
