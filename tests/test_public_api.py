"""The public API the regroup kept: every name aioengine exported before it, the CLI's entry point, and the
module paths users import leaf types from."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

# aioengine.__all__ as it was before the package was regrouped into engine/, model/ and cli/.
BEFORE = [
    "AioEngineError",
    "AsyncEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineNotStartedError",
    "GenerateHandle",
    "InvalidRequestError",
    "RequestOutput",
    "SamplingParams",
]
LEAF_MODULES = {
    "aioengine.config": ["EngineArgs", "KernelConfig"],
    "aioengine.sampling_params": ["SamplingParams", "StructuredOutputsParams"],
    "aioengine.outputs": ["RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"],
    "aioengine.errors": ["AioEngineError", "EngineDeadError", "InvalidRequestError"],
}


def test_every_name_exported_before_is_still_exported():
    import aioengine

    assert set(BEFORE) <= set(aioengine.__all__)
    for name in BEFORE:
        assert getattr(aioengine, name) is not None, name
    assert aioengine.__version__ == importlib.metadata.version("aioengine")


def test_leaf_types_keep_their_modules():
    for module, names in LEAF_MODULES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name}"


def test_the_console_script_and_python_m_still_run():
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "aioengine"]
    assert script.value == "aioengine.cli:main"
    main = script.load()
    assert callable(main)
    for argv in (["aioengine", "--help"], ["aioengine", "bench"]):
        proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert "serve" in out or "throughput" in out, out


def test_a_source_tree_on_the_path_imports_without_package_metadata():
    """Run from a checkout on PYTHONPATH (not installed, as on the GPU machines) the package still imports."""
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "def version(name):\n"
        "    if name == 'aioengine':\n"
        "        raise m.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "m.version = version\n"
        "import aioengine, aioengine.http.routes\n"
        "print(aioengine.__version__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["0+unknown"], proc.stderr
