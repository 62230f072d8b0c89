"""A burst load generator in its own process: N completions at once, each one's status and answer time.

`python -m tests.http.loadgen URL N MAX_TOKENS OUT [HEALTH_EVERY]` writes to OUT a JSON list of [status,
seconds, retry_after, body, sent_at, path], `seconds` running from the moment the request was written to the
moment its status line came back, `sent_at` that moment as a time.perf_counter() value (CLOCK_MONOTONIC on
Linux: it compares with times taken in the server's process). With HEALTH_EVERY k, a `GET /health` goes out
after every k completions, in the same burst: its round trip is the unit the server's answers are measured in.
Every connection is open before the first request goes out, and the requests are pre-encoded HTTP/1.1 bytes
over plain asyncio streams: an aiohttp client spends ~0.1 ms of CPU per request, which on two shared cores
would delay reading the answers it times. A separate process (with uvloop) shares no loop, GIL or thread with
the server it measures.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import orjson


async def _one(host: str, port: int, path: str, raw: bytes, start: asyncio.Event) -> list:
    reader, writer = await asyncio.open_connection(host, port)
    await start.wait()  # every connection is open before the first request goes out
    writer.write(raw)
    sent = time.perf_counter()
    status_line = await reader.readline()
    answered = time.perf_counter()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    writer.close()
    return [
        int(status_line.split()[1]),
        answered - sent,
        headers.get("retry-after"),
        orjson.loads(body) if body else None,
        sent,
        path,
    ]


async def burst(url: str, n: int, max_tokens: int, health_every: int = 0) -> list[list]:
    parts = urlsplit(url)
    start = asyncio.Event()
    prefix = parts.path.rstrip("/")
    raws = []
    for i in range(n):
        body = orjson.dumps(
            {
                "prompt": f"Request {i}: once upon a time",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
        )
        raws.append(
            (
                "/v1/completions",
                f"POST {prefix}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body,
            )
        )
        if health_every and (i + 1) % health_every == 0:
            raws.append(
                (
                    "/health",
                    f"GET {prefix}/health HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                    f"Connection: close\r\n\r\n".encode(),
                )
            )
    tasks = [asyncio.create_task(_one(parts.hostname, parts.port, path, raw, start)) for path, raw in raws]
    await asyncio.sleep(0.5)
    start.set()
    return await asyncio.gather(*tasks)


def main(argv: list[str]) -> None:
    url, n, max_tokens, out = argv[0], int(argv[1]), int(argv[2]), Path(argv[3])
    health_every = int(argv[4]) if len(argv) > 4 else 0
    need = n + (n // health_every if health_every else 0) + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard)
        )
    import uvloop

    out.write_bytes(orjson.dumps(uvloop.run(burst(url, n, max_tokens, health_every))))


if __name__ == "__main__":
    main(sys.argv[1:])
