"""The event loop stays responsive while the engine decodes: the forward runs off the loop thread."""

import asyncio

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.bench.loop_lag import LoopLagProbe


def test_loop_lag_p99_while_32_requests_decode():
    async def main():
        async with AsyncEngine(EngineArgs(model="default", max_model_len=1024)) as engine:
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))  # warm up
            probe = LoopLagProbe().start()
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            await asyncio.gather(*(engine.generate(list(range(100 + i, 164 + i)), params) for i in range(32)))
            await probe.stop()
            return probe

    probe = asyncio.run(main())
    assert len(probe.lags) > 200
    # A forward of 32 decodes takes tens of ms: were it on the loop thread, p99 would exceed that.
    assert probe.percentile(0.99) < 0.050, f"loop lag p99 {probe.percentile(0.99) * 1e3:.1f} ms"
