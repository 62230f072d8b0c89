"""Greedy parity: the engine's tokens equal transformers' generate on each prompt alone."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams

NEW_TOKENS = 10
# The parity cases' engine arguments: prompts chunked; a shared prefix hit; a pool that forces preemption.
CASES = {
    "chunked": dict(max_num_batched_tokens=24, enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=256),
    "preempt": dict(max_num_batched_tokens=64, num_kv_blocks=1 + 40),
}


def prompts(shared_prefix: bool, n: int = 16) -> list[list[int]]:
    rng = random.Random(1)
    prefix = [rng.randrange(3, 49152) for _ in range(40)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(3, 50))]
        out.append(prefix + tail if shared_prefix else tail)
    return out


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


async def run_engine(path, prompts_: list[list[int]], **kwargs) -> tuple[list[list[int]], AsyncEngine]:
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=4, **kwargs)
    engine = AsyncEngine(args)
    await engine.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts_))
        assert engine.kv_cache_usage() == 0.0
        return [o.outputs[0].token_ids for o in outs], engine
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("case", ["chunked", "prefix", "preempt"])
def test_greedy_parity_with_transformers(tiny_checkpoint, case):
    kind, path, hf = tiny_checkpoint
    ps = prompts(shared_prefix=case == "prefix")
    expected = [hf_greedy(hf, p) for p in ps]
    kwargs = CASES[case]
    got, engine = asyncio.run(run_engine(path, ps, **kwargs))
    assert got == expected
    sched = engine.scheduler
    if case == "prefix":
        assert sched.kv_cache_manager.total_prefix_cache.hits > 0
    if case == "preempt":
        assert sched.num_preemptions_total > 0
