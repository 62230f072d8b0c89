"""Structured vs unconstrained decoding speed: N concurrent JSON-schema requests, then N unconstrained
requests forced to the very same token counts (ignore_eos, max_tokens = what each structured one produced),
so both runs have the same batch shapes step by step. Rounds alternate to even out machine noise.

    aioengine bench structured [--model default] [--n 32] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aioengine.config import EngineArgs
from aioengine.engine import AsyncEngine
from aioengine.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
}
TOPICS = ["a chef", "a pilot", "a painter", "a student", "a farmer", "a doctor", "a musician", "a teacher"]


async def _run(engine: AsyncEngine, params: list[SamplingParams]) -> tuple[float, list[int], list[float]]:
    async def one(i: int, p: SamplingParams) -> tuple[int, float]:
        msgs = [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (person {i}) as JSON."}]
        first: float | None = None
        last: float | None = None
        n = 0
        async for delta in engine.chat(msgs, p):
            now = time.perf_counter()
            k = len(delta.outputs[0].token_ids) if delta.outputs else 0
            if k and first is None:
                first = now
            n += k
            last = now
        tpot = 0.0
        if n > 1:
            assert first is not None and last is not None  # set by the tokens counted in n
            tpot = (last - first) / (n - 1)
        return n, tpot

    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(i, p) for i, p in enumerate(params)))
    wall = time.perf_counter() - t0
    return wall, [n for n, _ in res], [t for _, t in res]


async def main(args: argparse.Namespace) -> dict:
    eargs = EngineArgs(model=args.model, max_model_len=1024, max_num_batched_tokens=2048, max_num_seqs=args.n)
    async with AsyncEngine(eargs) as engine:
        structured = StructuredOutputsParams(json=SCHEMA)

        def params(i: int, **kw: Any) -> SamplingParams:
            return SamplingParams(temperature=args.temperature, seed=i, **kw)

        # warm up (and compile the grammar once: the cache serves every later request)
        await _run(engine, [params(i, max_tokens=8, structured_outputs=structured) for i in range(4)])
        rows = []
        for _ in range(args.rounds):
            wall_s, counts, tpot_s = await _run(
                engine,
                [params(i, max_tokens=args.max_tokens, structured_outputs=structured) for i in range(args.n)],
            )
            wall_u, counts_u, tpot_u = await _run(
                engine, [params(i, max_tokens=c, ignore_eos=True) for i, c in enumerate(counts)]
            )
            assert counts_u == counts
            rows.append((sum(counts), wall_s, wall_u, statistics.mean(tpot_s), statistics.mean(tpot_u)))
        best_s = min(r[1] for r in rows)
        best_u = min(r[2] for r in rows)
        tokens = rows[0][0]
        result = {
            "n": args.n,
            "tokens": tokens,
            "temperature": args.temperature,
            "structured_tok_s": round(tokens / best_s, 1),
            "unconstrained_tok_s": round(tokens / best_u, 1),
            "structured_tpot_ms": round(1e3 * min(r[3] for r in rows), 2),
            "unconstrained_tpot_ms": round(1e3 * min(r[4] for r in rows), 2),
            "extra_time_per_token_pct": round(100 * (best_s / best_u - 1), 1),
            "grammar_cache": {
                "hits": engine._structured.cache_hits,
                "misses": engine._structured.cache_misses,
            },
        }
        return result


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="aioengine bench structured",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="default")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=2)
    print(json.dumps(asyncio.run(main(ap.parse_args(argv))), indent=2))


if __name__ == "__main__":
    cli()
