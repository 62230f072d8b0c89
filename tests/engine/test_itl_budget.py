"""The ITL-aware token budget in a real engine: the runner reports each step's time, the scheduler's cost
model learns from it, and no step's prompt chunks beside decodes take more than the model allows: with a
fixed target below any step's cost, the one block a step that keeps prompts moving; with a relative one,
what fits in the decodes' own predicted time times the ratio. Decodes go on and greedy tokens stay exact."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from tests.engine.test_parity import NEW_TOKENS, hf_greedy

BLOCK = 8


@pytest.mark.parametrize("target", [{"target_itl_ms": 0.01}, {"target_itl_ratio": 1.01}], ids=["ms", "ratio"])
def test_no_step_takes_more_prompt_than_the_target_allows(tiny_llama, target):
    path, hf = tiny_llama
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, size=int(n)).tolist() for n in (20, 200, 30, 160, 12, 220)]
    steps = []
    scheduled = []
    ms, ratio = target.get("target_itl_ms", 0.0), target.get("target_itl_ratio", 0.0)

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
                model = sched.step_cost
                base = sched._decode_features()
                decodes = model.predict(base)
                out = original()
                scheduled.append(out)
                if decodes is None or not base.decode_rows:
                    return out  # no fit yet, or no decode to protect: not cut
                # what the step holds against its limit (the fit does not move within schedule())
                planned = model.margin * model.predict(out.step_features)
                limit = max(ms / 1e3, ratio * decodes)
                steps.append((out.step_features.prefill_tokens, planned <= limit * (1 + 1e-9), out))
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
    assert observations >= len(scheduled) - 2  # every step's measured time reached the fit (two in flight)
    with_prompt = [(tokens, within, out) for tokens, within, out in steps if tokens]
    assert with_prompt  # prompt chunks beside decodes, under a fit
    for tokens, within, out in with_prompt:
        # within the limit, or the floor: one block a step, the prompt still moves
        assert within or tokens <= BLOCK, out.num_scheduled_tokens
    if ms:  # 10 us is below any step's cost: every chunk beside decodes is the floor
        assert caps > 0 and len(with_prompt) > 10
        assert all(tokens <= BLOCK for tokens, _, _ in with_prompt)
