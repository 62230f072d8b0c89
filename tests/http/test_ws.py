"""The websocket protocol (docs/websocket.md): start/delta/done, usage, cancel, many generations, errors."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def _collect(ws: aiohttp.ClientWebSocketResponse, gen_id: str) -> dict:
    """Messages of one generation until its done/error: {"start", "deltas", "end"}."""
    out: dict = {"deltas": []}
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), 60)
        assert msg["id"] == gen_id, msg
        if msg["type"] == "start":
            out["start"] = msg
        elif msg["type"] == "delta":
            out["deltas"].append(msg)
        else:
            out["end"] = msg
            return out


def run_ws(server, fn, app: str = "main", query: str = "", headers: dict | None = None):
    async def main():
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(server.url(app) + "/v1/ws" + query, headers=headers) as ws,
        ):
            return await fn(ws)

    return asyncio.run(main())


def test_chat_generation_streams_and_reports_usage(server):
    async def fn(ws):
        await ws.send_json(
            {"type": "chat", "id": "a", "body": {"messages": CHAT, "temperature": 0, "max_tokens": 20}}
        )
        return await _collect(ws, "a")

    got = run_ws(server, fn)
    assert got["start"]["model"] == "default" and got["start"]["request_id"].startswith("chatcmpl-")
    text = "".join(d["text"] for d in got["deltas"])
    assert "Paris" in text and len(got["deltas"]) >= 2
    end = got["end"]
    assert end["type"] == "done" and end["choices"][0]["finish_reason"] in ("stop", "length")
    assert end["usage"]["completion_tokens"] == sum(len(d["token_ids"]) for d in got["deltas"])
    assert server.wait_idle()["unfinished"] == 0


def test_two_generations_on_one_socket_sequential_and_concurrent(server):
    async def fn(ws):
        await ws.send_json({"type": "completion", "id": 1, "body": {"prompt": "Hello", "max_tokens": 4}})
        first = await _collect(ws, "1")
        await ws.send_json(
            {
                "type": "completion",
                "id": "second",
                "body": {"prompt": "Hi", "max_tokens": 3, "temperature": 0},
            }
        )
        second = await _collect(ws, "second")
        # Two at once, interleaved on the socket.
        for gid in ("x", "y"):
            await ws.send_json(
                {"type": "chat", "id": gid, "body": {"messages": CHAT, "max_tokens": 5, "temperature": 0}}
            )
        ends: dict = {}
        texts = {"x": "", "y": ""}
        while len(ends) < 2:
            msg = await asyncio.wait_for(ws.receive_json(), 60)
            if msg["type"] == "delta":
                texts[msg["id"]] += msg["text"]
            elif msg["type"] == "done":
                ends[msg["id"]] = msg
        return first, second, ends, texts

    first, second, ends, texts = run_ws(server, fn)
    assert (
        first["end"]["usage"]["completion_tokens"] == 4 and second["end"]["usage"]["completion_tokens"] <= 3
    )
    assert texts["x"] == texts["y"] and texts["x"]  # same greedy prompt, same answer
    assert set(ends) == {"x", "y"}


def test_cancel_aborts_and_socket_stays_usable(server):
    async def fn(ws):
        await ws.send_json(
            {
                "type": "completion",
                "id": "long",
                "body": {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True},
            }
        )
        while (msg := await ws.receive_json())["type"] != "delta":
            pass
        await ws.send_json({"type": "cancel", "id": "long"})
        while (msg := await asyncio.wait_for(ws.receive_json(), 10))["type"] != "done":
            assert msg["type"] == "delta"
        cancelled = msg
        state = server.engine_state()
        await ws.send_json({"type": "cancel", "id": "long"})  # no longer running: an error, not a crash
        late = await ws.receive_json()
        await ws.send_json({"type": "ping", "id": 7})
        pong = await ws.receive_json()
        await ws.send_json({"type": "completion", "id": "after", "body": {"prompt": "Hi", "max_tokens": 2}})
        after = await _collect(ws, "after")
        return cancelled, state, late, pong, after

    cancelled, state, late, pong, after = run_ws(server, fn)
    assert cancelled["choices"][0]["finish_reason"] == "abort"
    assert cancelled["usage"]["completion_tokens"] < 1000
    assert state["unfinished"] == 0 and state["kv_usage"] == 0.0
    assert late["type"] == "error" and late["error"]["code"] == "generation_not_found"
    assert pong == {"type": "pong", "id": "7"}
    assert after["end"]["type"] == "done"


def test_closing_the_socket_aborts_its_generations(server):
    async def fn(ws):
        for i in range(3):
            await ws.send_json(
                {"type": "chat", "id": i, "body": {"messages": CHAT, "max_tokens": 1000, "ignore_eos": True}}
            )
        seen = set()
        while len(seen) < 3:
            msg = await ws.receive_json()
            if msg["type"] == "delta":
                seen.add(msg["id"])
        assert server.engine_state()["unfinished"] == 3

    run_ws(server, fn)
    assert server.wait_idle() == {"running": 0, "waiting": 0, "kv_usage": 0.0, "unfinished": 0}


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ("not json", 400, None),
        ("[1]", 400, None),
        ('{"type": "dance"}', 400, "type"),
        ('{"type": "chat", "id": "a"}', 400, "body"),
        ('{"type": "chat", "id": "a", "body": {"messages": []}}', 400, "messages"),
        (
            '{"type": "chat", "id": "a", "body": {"messages": [{"role": "user", "content": "x"}], '
            '"max_tokens": "x"}}',
            400,
            "max_tokens",
        ),
        ('{"type": "completion", "id": "a", "body": {"prompt": "x", "model": "nope"}}', 404, "model"),
        ('{"type": "completion", "id": true, "body": {"prompt": "x"}}', 400, "id"),
        ('{"type": "completion", "id": "a", "body": {"prompt": "x"}, "extra": 1}', 400, "extra"),
        ('{"type": "cancel", "id": "nothing"}', 404, "id"),
    ],
)
def test_bad_messages_get_error_messages(server, message, status, param):
    async def fn(ws):
        await ws.send_str(message)
        err = await asyncio.wait_for(ws.receive_json(), 10)
        await ws.send_json({"type": "ping"})
        return err, await ws.receive_json()

    err, pong = run_ws(server, fn)
    assert err["type"] == "error" and err["error"]["status"] == status and err["error"]["param"] == param
    assert err["error"]["message"]
    assert pong["type"] == "pong"
