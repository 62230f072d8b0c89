"""Every environment variable aioengine reads or sets, in one place (kernel choices are EngineArgs).

The only ones written are HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, around transformers' loaders
(``hf_offline``), so that nothing reaches for the network.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
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


def torchrun_master() -> tuple[str, str] | None:
    """torchrun's MASTER_ADDR and MASTER_PORT, when both are set (a TP group's TCP store)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, port) if addr and port else None


def torchrun_master_given() -> bool:
    """Whether MASTER_ADDR is set: the user placed the TP group's store themselves."""
    return "MASTER_ADDR" in os.environ


_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """transformers and huggingface_hub kept off the network while a loader runs; restored afterwards."""
    saved = {k: os.environ.get(k) for k in _OFFLINE}
    os.environ.update(dict.fromkeys(_OFFLINE, "1"))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def replica_environment(index: int, num_replicas: int, gpus_per_replica: int = 1) -> dict[str, str]:
    """The environment of data-parallel replica ``index`` of ``num_replicas``: this one, with its own
    ``gpus_per_replica`` GPUs (CUDA_VISIBLE_DEVICES) when that many are listed for each replica. Unset, every
    replica sees every GPU: list them to split them."""
    env = dict(os.environ)
    gpus = env.get("CUDA_VISIBLE_DEVICES")
    ids = gpus.split(",") if gpus else []
    if len(ids) >= num_replicas * gpus_per_replica:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index * gpus_per_replica : (index + 1) * gpus_per_replica])
    return env
