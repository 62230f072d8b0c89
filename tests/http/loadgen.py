"""A burst load generator in its own process: N completions at once, each one's status and answer time.

`python -m tests.http.loadgen URL N MAX_TOKENS OUT` writes to OUT a JSON list of [status, seconds, retry_after, body],
`seconds` running from the moment the request's headers were sent to the moment its response headers came
back. A separate process (with uvloop) shares no event loop, GIL or thread with the server it measures.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson


async def _sent(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    ctx.trace_request_ctx.sent = time.perf_counter()


async def burst(url: str, n: int, max_tokens: int) -> list[list]:
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_sent)

    async def one(session: aiohttp.ClientSession, i: int) -> list:
        ctx = SimpleNamespace(sent=None)
        body = {"prompt": f"Request {i}: once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0}
        async with session.post(url + "/v1/completions", json=body, trace_request_ctx=ctx) as r:
            answered = time.perf_counter()
            return [r.status, answered - ctx.sent, r.headers.get("Retry-After"), orjson.loads(await r.read())]

    connector = aiohttp.TCPConnector(limit=n + 50)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[trace],
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(n)))


def main(argv: list[str]) -> None:
    url, n, max_tokens, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 256 if hard == resource.RLIM_INFINITY else min(n + 256, hard), hard))
    import uvloop

    out.write_bytes(orjson.dumps(uvloop.run(burst(url, n, max_tokens))))


if __name__ == "__main__":
    main(sys.argv[1:])
