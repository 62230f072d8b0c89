"""Peak and settled resident memory of starting the engine on a model: ``VmHWM`` (the peak) and ``VmRSS``
once the engine is up and one request has run, and their ratio (the load's overhead over the loaded model).

usage: python scripts/load_rss.py --model MODEL [engine flags: --cpu-isa avx2 ...]
A converted GGUF is converted before this runs (its conversion is a separate, one-time process).
"""

from __future__ import annotations

import argparse
import asyncio

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.cli.common import add_engine_args, engine_args_from


def status() -> dict[str, int]:
    """This process's VmRSS and VmHWM, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) >> 10
    return out


async def main(args: EngineArgs) -> None:
    async with AsyncEngine(args) as engine:
        await engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
        mem = status()
    ratio = mem["VmHWM"] / mem["VmRSS"]
    print(f"peak RSS {mem['VmHWM']} MiB, settled RSS {mem['VmRSS']} MiB, peak / settled {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    asyncio.run(main(engine_args_from(parser.parse_args())))
