"""A request's limits in the engine: a deadline (SamplingParams.timeout_s) and the grammar compile limit
(EngineArgs.grammar_compile_timeout_s)."""

from __future__ import annotations

import asyncio
import time

import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import StructuredOutputsParams


def test_a_grammar_past_the_compile_limit_is_refused_and_others_still_run(tiny_llama):
    path, _ = tiny_llama
    props = {f"p{j}": {"type": "string", "pattern": "[a-z]{1,8}[0-9]{2,4}"} for j in range(3000)}
    huge = StructuredOutputsParams(json={"type": "object", "properties": props, "required": list(props)})

    async def main():
        engine = AsyncEngine(EngineArgs(model=str(path), dtype="float32", grammar_compile_timeout_s=0.05))
        async with engine:
            t0 = time.monotonic()
            with pytest.raises(InvalidRequestError, match="did not compile within 0.05 s") as e:
                await engine.precompile(SamplingParams(structured_outputs=huge))
            assert e.value.param == "structured_outputs" and time.monotonic() - t0 < 2
            small = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]{4}"))
            grammar = await engine.precompile(small)
            out = await engine.generate([1, 2, 3], small, grammar=grammar)
            assert len(out.outputs[0].text) == 4 and set(out.outputs[0].text) <= {"a", "b"}

    asyncio.run(main())


def test_a_deadline_from_python_is_the_same(tiny_llama):
    path, _ = tiny_llama

    async def main():
        async with AsyncEngine(EngineArgs(model=str(path), dtype="float32")) as engine:
            # A loaded machine may pass a short deadline before the first token, a fast one may finish 500
            # tokens before a long one: double the deadline until one lands mid-generation.
            mid = []
            for timeout_s in (0.2, 0.4, 0.8, 1.6, 3.2):
                params = SamplingParams(max_tokens=500, ignore_eos=True, timeout_s=timeout_s)
                out = (await engine.generate([1, 2, 3], params)).outputs[0]
                assert out.finish_reason == ("length" if len(out.token_ids) == 500 else "timeout")
                assert engine.scheduler.kv_cache_manager.usage == 0.0
                assert engine.num_unfinished_requests() == 0
                if out.finish_reason == "timeout" and out.token_ids:
                    mid.append(len(out.token_ids))
                    break
            assert mid, "no deadline landed between the first token and the last"
            with pytest.raises(InvalidRequestError, match="timeout_s"):
                engine.generate([1, 2], SamplingParams(timeout_s=0))

    asyncio.run(main())
