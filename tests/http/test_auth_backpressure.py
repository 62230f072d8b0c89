"""--api-key (401s, constant-time compare, open /health and /metrics) and --max-num-queued-reqs (503)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from tests.http.conftest import API_KEY, MAX_NUM_SEQS, QUEUE_LIMIT, Http
from tests.timing import HANG_S, medians_s

REFUSAL_PER_HEALTH = 3  # a 503's round trip (median of 5) within 3 times that of a /health beside it


@pytest.fixture(scope="module")
def keyed(server):
    return Http(server.url("keyed"))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": "Bearer "},
    ],
)
@pytest.mark.parametrize(
    "route",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/tokenize"),
        ("GET", "/v1/nope"),
    ],
)
def test_missing_or_wrong_key_is_401(keyed, headers, route):
    r = keyed.request(*route, body=b"{}", headers=headers)
    assert r.status == 401
    err = r.json()["error"]
    assert err["type"] == "AuthenticationError" and err["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_works_and_open_routes_stay_open(keyed, server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert keyed.get("/v1/models", headers=auth).status == 200
    assert keyed.post("/tokenize", json={"prompt": "hi"}, headers=auth).status == 200
    for path in ("/health", "/metrics", "/version", "/openapi.json", "/"):
        assert keyed.get(path).status == 200, path
    client = openai.OpenAI(base_url=server.url("keyed") + "/v1", api_key=API_KEY, max_retries=0)
    r = client.completions.create(model="default", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("keyed") + "/v1", api_key="nope", max_retries=0).models.list()


def test_websocket_needs_the_key(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(server.url("keyed") + "/v1/ws")
            assert e.value.status == 401
            for kw in ({"headers": {"Authorization": f"Bearer {API_KEY}"}}, {"params": {"api_key": API_KEY}}):
                async with s.ws_connect(server.url("keyed") + "/v1/ws", **kw) as ws:
                    await ws.send_json({"type": "ping"})
                    assert (await ws.receive_json())["type"] == "pong"

    asyncio.run(main())


@pytest.mark.serial  # it compares a refusal's time with /health's, under load
def test_queue_full_is_503_with_retry_after_without_touching_the_engine(server):
    limited = Http(server.url("limited"))
    n_streams = MAX_NUM_SEQS + QUEUE_LIMIT
    body = {
        "messages": [{"role": "user", "content": "Write a long poem."}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }

    async def main():
        async with aiohttp.ClientSession() as s:
            resps = await asyncio.gather(
                *(s.post(server.url() + "/v1/chat/completions", json=body) for _ in range(n_streams))
            )
            try:
                deadline = time.monotonic() + HANG_S
                while (state := server.engine_state())[
                    "running"
                ] < MAX_NUM_SEQS and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # admission takes a step or two (token budget)
                assert (state["running"], state["waiting"]) == (MAX_NUM_SEQS, QUEUE_LIMIT)
                # Refusals and /health calls in turn, under the same load (the engine decoding 16 streams).
                refused: list = []
                refusal_s, health_s = await asyncio.to_thread(
                    medians_s,
                    [
                        lambda: refused.append(limited.post("/v1/chat/completions", json=body)),
                        lambda: limited.get("/health"),
                    ],
                    5,
                )
                ws_err = None
                async with s.ws_connect(server.url("limited") + "/v1/ws") as ws:
                    await ws.send_json({"type": "chat", "id": "q", "body": body})
                    ws_err = await ws.receive_json()
                after = server.engine_state()["unfinished"]
                return refused, refusal_s, health_s, ws_err, after
            finally:
                for resp in resps:
                    resp.close()

    refused, refusal_s, health_s, ws_err, unfinished = asyncio.run(main())
    for r in refused:
        assert r.status == 503 and r.headers["retry-after"] == "1"
        assert (
            r.json()["error"]["code"] == "queue_full"
            and r.json()["error"]["type"] == "ServiceUnavailableError"
        )
    # As quick as the cheapest answer: a refusal that waited for the engine (a step) would take far longer.
    assert refusal_s < REFUSAL_PER_HEALTH * health_s, (refusal_s, health_s)
    assert ws_err["type"] == "error" and ws_err["error"]["status"] == 503
    assert unfinished == n_streams  # the refused requests never reached the engine
    assert server.wait_idle()["unfinished"] == 0
    # Below the limit again: the same app serves.
    assert limited.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status == 200
