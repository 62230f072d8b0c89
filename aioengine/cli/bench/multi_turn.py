"""`aioengine bench multi-turn`: interleaved multi-turn chats against a running server (one engine, or a
data-parallel front, a Ray Serve application): TTFT p50/p99, output tokens/s, and the prefix-cache hit rate
the server's /metrics counted over the run (summed over replicas), with the tokens the KV offload tiers gave
back. Where /metrics counts no prefix-cache queries (Ray Serve's ingress reports its router instead), the
hit rate is the replies' own: cached prompt tokens over prompt tokens, from each stream's usage.

Each of ``--conversations`` chats has ``--turns`` user turns; turn t of every conversation is sent before
turn t + 1 of any (at most ``--max-concurrency`` at once), so a conversation's next turn finds its prefix
only where the previous turn ran, or where the routing sent it back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time

import aiohttp

_TOPICS = ("the history of Paris", "how bridges carry loads", "the life of bees", "why the sky is blue")


_COUNTERS = (
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "kv_offload_host_hits_total",
    "kv_offload_disk_reads_total",
)


def _hits(metrics: str) -> list[float]:
    """The counters above, summed over replicas."""

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^aioengine:{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))

    return [total(name) for name in _COUNTERS]


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    chats = [
        [
            {
                "role": "user",
                "content": f"Chat {c}. Tell me about {rng.choice(_TOPICS)}. " + "Be thorough. " * 20,
            }
        ]
        for c in range(args.conversations)
    ]
    ttfts: list[float] = []
    tokens = 0
    context = [0] * len(chats)  # each conversation's prompt and reply tokens at its latest turn
    prompt_tokens = cached_tokens = 0
    gate = asyncio.Semaphore(args.max_concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        before = _hits(await (await s.get(args.base_url + "/metrics")).text())

        async def turn(c: int, history: list[dict]) -> None:
            nonlocal tokens, prompt_tokens, cached_tokens
            body = {
                "messages": history,
                "max_tokens": args.output_len,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with gate:
                t0 = time.perf_counter()
                first = None
                text = []
                async with s.post(args.base_url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage")
                        if usage:
                            tokens += usage["completion_tokens"]
                            context[c] = usage["total_tokens"]
                            prompt_tokens += usage["prompt_tokens"]
                            details = usage.get("prompt_tokens_details") or {}
                            cached_tokens += details.get("cached_tokens", 0)
                        for choice in chunk.get("choices", []):
                            piece = choice["delta"].get("content")
                            if piece:
                                first = first or time.perf_counter()
                                text.append(piece)
                ttfts.append(((first or time.perf_counter()) - t0) * 1000)
            history += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": "Go on."},
            ]

        t0 = time.perf_counter()
        for _ in range(args.turns):
            await asyncio.gather(*(turn(c, h) for c, h in enumerate(chats)))
        elapsed = time.perf_counter() - t0
        after = _hits(await (await s.get(args.base_url + "/metrics")).text())
    hits, queries, host_hits, disk_reads = (a - b for a, b in zip(after, before, strict=True))
    usage_rate = cached_tokens / prompt_tokens if prompt_tokens else 0.0
    q = statistics.quantiles(ttfts, n=100)
    return {
        "requests": len(ttfts),
        "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p99_ms": q[98],
        "prefix_hit_rate": hits / queries if queries else usage_rate,
        "usage_hit_rate": usage_rate,  # the replies' cached_tokens over their prompt_tokens
        # of the hits, the tokens loaded back from the offload tiers (disk reads land in the host tier)
        "offload_host_hit_tokens": int(host_hits),
        "offload_disk_read_blocks": int(disk_reads),
        "elapsed_s": elapsed,
        "context_tokens": sum(context),  # what the last turns hold together (against the KV pool's size)
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="aioengine bench multi-turn", description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key")
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    result = asyncio.run(run(args))
    print(
        f"Multi-turn: {result['requests']} requests in {result['elapsed_s']:.1f} s "
        f"({result['context_tokens']} tokens of context at the last turns), "
        f"{result['output_tokens_per_s']:.1f} output tokens/s; TTFT p50 {result['ttft_p50_ms']:.0f} ms, "
        f"p99 {result['ttft_p99_ms']:.0f} ms; prefix-cache hit rate {result['prefix_hit_rate']:.1%} "
        f"(offload tiers: {result['offload_host_hit_tokens']} tokens from host; "
        f"{result['offload_disk_read_blocks']} blocks read from disk into it)"
    )
    return result
