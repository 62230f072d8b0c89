"""Clients that vanish mid-request abort their engine requests at once, freeing every KV block.

"At once" is counted in engine steps: the engine is empty within a few steps of the drop (conftest's
IDLE_STEPS: the steps already in flight), where the requests asked for 1,000 tokens each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp

from tests.http.conftest import MAX_NUM_SEQS
from tests.timing import HANG_S

N_CLIENTS = 20


def _body(i: int, stream: bool) -> dict:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": f"Count to a thousand, #{i}."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": stream,
    }


async def _open_streams(url: str, n: int) -> tuple[aiohttp.ClientSession, list]:
    session = aiohttp.ClientSession()
    resps = await asyncio.gather(
        *(session.post(url + "/v1/chat/completions", json=_body(i, True)) for i in range(n))
    )
    for r in resps:
        assert r.status == 200
        first = await r.content.readline()  # the role chunk, sent as soon as the request is accepted
        assert first.startswith(b"data: ")
    return session, resps


def test_dropped_streams_free_everything(server):
    async def main() -> int:
        session, resps = await _open_streams(server.url(), N_CLIENTS)
        # Let the running ones produce tokens: they are mid-stream when dropped.
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            line = await resps[0].content.readline()
            if b'"content"' in line and b'"content":""' not in line:
                break
        state = server.engine_state()
        assert state["running"] == MAX_NUM_SEQS and state["waiting"] == N_CLIENTS - MAX_NUM_SEQS
        assert state["kv_usage"] > 0
        dropped_at = server.steps()
        for r in resps:
            r.close()  # drops the TCP connection
        await session.close()
        return dropped_at

    dropped_at = asyncio.run(main())
    state = server.wait_idle(since=dropped_at)
    assert state == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}, (
        f"{server.steps() - dropped_at} steps after the drop: {state}"
    )


def test_dropped_non_streaming_request_is_aborted(server):
    async def main() -> int:
        async with aiohttp.ClientSession() as session:
            post = asyncio.create_task(
                session.post(server.url() + "/v1/chat/completions", json=_body(0, False))
            )
            started = server.steps()
            deadline = time.monotonic() + HANG_S
            # Hang up mid-generation: once the engine has run the request for two steps.
            while not (server.engine_state()["running"] == 1 and server.steps() - started >= 2):
                assert time.monotonic() < deadline and not post.done()
                await asyncio.sleep(0.01)
            assert server.engine_state()["unfinished"] == 1  # still generating when we hang up
            dropped_at = server.steps()
            post.cancel()  # drops the connection
            with contextlib.suppress(asyncio.CancelledError):
                await post
            return dropped_at

    dropped_at = asyncio.run(main())
    state = server.wait_idle(since=dropped_at)
    assert state == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}, (
        f"{server.steps() - dropped_at} steps after the drop: {state}"
    )
