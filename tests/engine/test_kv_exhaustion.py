"""KV exhaustion: 64 concurrent long requests on a pool that fits 8 all finish, equal to a large-pool run."""

import asyncio
import random

from aioengine import AsyncEngine, EngineArgs, SamplingParams


async def _run(path, num_kv_blocks: int) -> tuple[list[list[int]], int, float]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(40, 60))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    args = EngineArgs(
        model=str(path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=256,
        max_num_seqs=64,
    )
    async with AsyncEngine(args) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return (
            [o.outputs[0].token_ids for o in outs],
            engine.scheduler.num_preemptions_total,
            engine.kv_cache_usage(),
        )


def test_64_requests_on_a_pool_for_8(tiny_llama):
    path, _ = tiny_llama
    # Each request needs at most 84 tokens = 21 blocks of 4: 8 of them fit in 168 blocks.
    small, preemptions, usage = asyncio.run(_run(path, 1 + 8 * 21))
    large, no_preemptions, _ = asyncio.run(_run(path, 1 + 64 * 21))
    assert preemptions > 0 and no_preemptions == 0
    assert small == large
    assert usage == 0.0
