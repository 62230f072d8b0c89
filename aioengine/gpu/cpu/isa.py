"""What this CPU can do, read once from /proc/cpuinfo: the features the backend's defaults depend on."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """avx512_bf16 or AMX: bf16 matmuls run several times faster than float32 on this CPU."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
