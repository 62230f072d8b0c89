"""The ITL-aware token budget in a real engine: the runner reports each step's time, the scheduler's cost
model learns from it, and with a target below any step's cost (a fixed one, or one barely above the decodes
alone) every prompt chunk beside decodes is cut to the one block a step that keeps prompts moving, while
decodes go on and greedy tokens stay exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from tests.engine.test_parity import NEW_TOKENS, hf_greedy

BLOCK = 8


@pytest.mark.parametrize(
    "target",
    [{"target_itl_ms": 0.01}, {"target_itl_ratio": 1.01}],  # below any step's cost: only the progress floor
    ids=["ms", "ratio"],
)
def test_a_tight_target_cuts_prompt_chunks_to_one_block(tiny_llama, target):
    path, hf = tiny_llama
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in (20, 200, 30, 160, 12, 220)]
    steps = []

    async def run():
        args = EngineArgs(
            model=str(path),
            dtype="float32",
            device="cpu",
            block_size=BLOCK,
            max_num_batched_tokens=256,
            **target,
        )
        async with AsyncEngine(args) as engine:
            sched = engine.scheduler
            original = sched.schedule

            def schedule():
                base = sched._decode_features()
                fitted = sched.step_cost.predict(base) is not None and base.decode_rows > 0
                out = original()
                steps.append((fitted, out.step_features.prefill_tokens, dict(out.num_scheduled_tokens)))
                return out

            sched.schedule = schedule
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            # The fit's first steps: several streams and a long prompt, so that it has seen what rows and
            # prompt tokens cost (one stream alone leaves those slopes to chance).
            warm = await asyncio.gather(*(engine.generate(p, params) for p in prompts[:3]))
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts[3:]))
            return [*warm, *outs], sched.step_cost.observations, sched.prefill_caps

    outs, observations, caps = asyncio.run(run())
    assert [o.outputs[0].token_ids[:NEW_TOKENS] for o in outs] == [hf_greedy(hf, p) for p in prompts]
    assert observations >= len(steps) - 2  # every step's measured time reached the fit (two in flight)
    fitted = [(tokens, planned) for ok, tokens, planned in steps if ok and tokens]
    assert len(fitted) > 10 and caps > 0
    for tokens, planned in fitted:
        assert tokens <= BLOCK, planned  # the floor: one block a step, the prompt still moves
