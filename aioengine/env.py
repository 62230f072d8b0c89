"""Every environment variable aioengine reads, in one place (kernel choices are EngineArgs, never variables).

Two kinds are written elsewhere, on purpose: ``model_files`` and ``tokenizer`` set HF_HUB_OFFLINE /
TRANSFORMERS_OFFLINE around transformers' loaders, so that nothing reaches for the network.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """Root of aioengine's cache: $AIOENGINE_CACHE_DIR, $XDG_CACHE_HOME/aioengine or ~/.cache/aioengine."""
    explicit = os.environ.get("AIOENGINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "aioengine"
    return Path.home() / ".cache" / "aioengine"


def c_compiler() -> str | None:
    """The compiler for the CPU's C kernels: $CC, else gcc or cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def api_key() -> str | None:
    """`aioengine serve`'s key when --api-key is not given: $AIOENGINE_API_KEY."""
    return os.environ.get("AIOENGINE_API_KEY") or None
