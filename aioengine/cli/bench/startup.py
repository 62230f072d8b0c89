"""`aioengine bench startup`: engine start to the first streamed token, default model.

usage: aioengine bench startup [--label LABEL]

It measures the engine's start within a process that has already imported the CLI (the clock starts in
main(), before aioengine's engine is imported here), so run it in a fresh process each time. Run with an
empty AIOENGINE_CACHE_DIR for a cold start (the GGUF is converted), again for a warm one.
"""

from __future__ import annotations

import argparse
import asyncio
import time


async def first_token(label: str, t0: float) -> None:
    from aioengine.config import EngineArgs
    from aioengine.engine.async_engine import AsyncEngine
    from aioengine.sampling_params import SamplingParams

    async with AsyncEngine(EngineArgs(model="default")) as engine:
        async for _ in engine.generate("Hello", SamplingParams(max_tokens=1)):
            print(f"{label} start to first token: {time.perf_counter() - t0:.1f} s")
            break


def main(argv: list[str]) -> None:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(prog="aioengine bench startup", description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="start", help="printed before the figure (e.g. cold, warm)")
    args = ap.parse_args(argv)
    asyncio.run(first_token(args.label, t0))
