"""aioengine.bench: `aioengine bench throughput | latency | serve | hf-peer | allreduce`, as vLLM's."""

from __future__ import annotations

import sys

_MODES = ("throughput", "latency", "serve", "hf-peer", "allreduce")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _MODES:
        print(
            f"usage: aioengine bench {{{','.join(_MODES)}}} [options]  (each mode has --help)",
            file=sys.stderr,
        )
        return 2
    mode, rest = argv[0], argv[1:]
    if mode == "throughput":
        from aioengine.bench.throughput import main as run
    elif mode == "latency":
        from aioengine.bench.latency import main as run
    elif mode == "allreduce":
        from aioengine.bench.allreduce import main as run
    elif mode == "hf-peer":
        from aioengine.bench.hf_peer import main as run
    else:
        from aioengine.bench.serve import main as run
    run(rest)
    return 0
