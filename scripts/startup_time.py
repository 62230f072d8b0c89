"""Engine start to the first streamed token, default model: `python scripts/startup_time.py LABEL`.

Run with an empty AIOENGINE_CACHE_DIR for a cold start (the GGUF is converted), again for a warm one.
"""

import asyncio
import sys
import time

t0 = time.perf_counter()

from aioengine import AsyncEngine, EngineArgs, SamplingParams  # noqa: E402


async def main() -> None:
    async with AsyncEngine(EngineArgs(model="default")) as engine:
        async for _ in engine.generate("Hello", SamplingParams(max_tokens=1)):
            label = sys.argv[1] if len(sys.argv) > 1 else "start"
            print(f"{label} start to first token: {time.perf_counter() - t0:.1f} s")
            break


asyncio.run(main())
