"""aioengine.cli.bench: `aioengine bench throughput | latency | serve | hf-peer | allreduce | scheduler |
structured | startup | attention | step-noise | linear-layouts | kv-cache-parity | itl-plot | multi-turn`, as
vLLM's."""

from __future__ import annotations

import sys
from collections.abc import Callable

_MODES = (
    "throughput",
    "latency",
    "serve",
    "hf-peer",
    "allreduce",
    "scheduler",
    "structured",
    "startup",
    "attention",
    "step-noise",
    "linear-layouts",
    "kv-cache-parity",
    "itl-plot",
    "multi-turn",
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _MODES:
        print(
            f"usage: aioengine bench {{{','.join(_MODES)}}} [options]  (each mode has --help)",
            file=sys.stderr,
        )
        return 2
    mode, rest = argv[0], argv[1:]
    run: Callable[[list[str]], object]  # each mode's entry point (some return their result)
    if mode == "throughput":
        from aioengine.cli.bench.throughput import main as run
    elif mode == "latency":
        from aioengine.cli.bench.latency import main as run
    elif mode == "allreduce":
        from aioengine.cli.bench.allreduce import main as run
    elif mode == "scheduler":
        from aioengine.cli.bench.scheduler import main as run
    elif mode == "structured":
        from aioengine.cli.bench.structured import cli as run
    elif mode == "hf-peer":
        from aioengine.cli.bench.hf_peer import main as run
    elif mode == "startup":
        from aioengine.cli.bench.startup import main as run
    elif mode == "attention":
        from aioengine.cli.bench.attention import main as run
    elif mode == "step-noise":
        from aioengine.cli.bench.step_noise import main as run
    elif mode == "linear-layouts":
        from aioengine.cli.bench.linear_layouts import main as run
    elif mode == "kv-cache-parity":
        from aioengine.cli.bench.kv_cache_parity import main as run
    elif mode == "itl-plot":
        from aioengine.cli.bench.itl_plot import main as run
    elif mode == "multi-turn":
        from aioengine.cli.bench.multi_turn import main as run
    else:
        from aioengine.cli.bench.serve import main as run
    run(rest)
    return 0
