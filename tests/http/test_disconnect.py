"""Clients that vanish mid-request abort their engine requests at once, freeing every KV block."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.http.conftest import MAX_NUM_SEQS

N_CLIENTS = 20


def _body(i: int, stream: bool) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": f"Count to a thousand, #{i}."}],
            "max_tokens": 1000, "ignore_eos": True, "temperature": 0.8, "stream": stream}


async def _open_streams(url: str, n: int) -> tuple[aiohttp.ClientSession, list]:
    session = aiohttp.ClientSession()
    resps = await asyncio.gather(*(session.post(url + "/v1/chat/completions", json=_body(i, True))
                                   for i in range(n)))
    for r in resps:
        assert r.status == 200
        first = await r.content.readline()  # the role chunk, sent as soon as the request is accepted
        assert first.startswith(b"data: ")
    return session, resps


def test_dropped_streams_free_everything(server):
    async def main() -> float:
        session, resps = await _open_streams(server.url(), N_CLIENTS)
        # Let the running ones produce tokens: they are mid-stream when dropped.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = await resps[0].content.readline()
            if b'"content"' in line and b'"content":""' not in line:
                break
        state = server.engine_state()
        assert state["running"] == MAX_NUM_SEQS and state["waiting"] == N_CLIENTS - MAX_NUM_SEQS
        assert state["kv_usage"] > 0
        for r in resps:
            r.close()  # drops the TCP connection
        await session.close()
        return time.monotonic()

    dropped_at = asyncio.run(main())
    state = server.wait_idle(2.0)
    assert state == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}
    assert time.monotonic() - dropped_at < 2.0


def test_dropped_non_streaming_request_is_aborted(server):
    async def main() -> bool:
        async with aiohttp.ClientSession() as session:
            try:
                await session.post(server.url() + "/v1/chat/completions", json=_body(0, False),
                                   timeout=aiohttp.ClientTimeout(total=0.5))
            except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
                return server.engine_state()["unfinished"] == 1  # still generating when we hung up
        return False

    assert asyncio.run(main())
    state = server.wait_idle(2.0)
    assert state == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}
