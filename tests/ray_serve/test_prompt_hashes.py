"""The ingress's prompt hashes are the engine's own: each body, served by the engine's own app, leaves exactly
the hashes PromptHasher computed for it in the prefix cache (one per full prompt block), for every prompt
route; a body it cannot read gets none. Runs without Ray (the hasher and the routing info are plain
Python), with the routing info pickled as Serve sends it."""

from __future__ import annotations

import asyncio
import pickle

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from aioengine import AsyncEngine, EngineArgs
from aioengine.http.app import build_app
from aioengine.ray_serve.prompt_hashes import PromptHasher
from aioengine.ray_serve.replica import routing_info

LONG = "Tell me about the history of the river that runs through the old town, in some detail. " * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
    "chat with a system prompt and history": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": LONG},
                {"role": "assistant", "content": "It is long."},
                {"role": "user", "content": "And then?"},
            ]
        },
    ),
    "chat with tools": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": LONG}], "tools": TOOLS},
    ),
    "completion text": ("/v1/completions", {"prompt": LONG}),
    "completion ids": ("/v1/completions", {"prompt": list(range(100, 180))}),
    "anthropic": ("/v1/messages", {"system": "Be brief.", "messages": [{"role": "user", "content": LONG}]}),
    "responses": ("/v1/responses", {"instructions": "Be brief.", "input": LONG}),
}


@pytest.fixture(scope="module")
def served():
    """(hasher, run(coro)) with an engine of the default model and its app, on one loop."""
    loop = asyncio.new_event_loop()
    engine = AsyncEngine(EngineArgs(model="default", max_model_len=1024, num_kv_blocks=256))
    loop.run_until_complete(engine.start())
    client = TestClient(TestServer(build_app(engine)), loop=loop)
    loop.run_until_complete(client.start_server())
    hasher = PromptHasher(pickle.loads(pickle.dumps(routing_info(engine))))
    yield engine, client, hasher, loop.run_until_complete
    loop.run_until_complete(client.close())
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.mark.parametrize("case", sorted(BODIES))
def test_hashes_are_the_blocks_the_engine_caches(served, case):
    engine, client, hasher, run = served
    path, body = BODIES[case]
    body = {"model": "default", "max_tokens": 1, "temperature": 0, **body}
    if path == "/v1/messages":
        body["max_tokens"] = 1
    elif path == "/v1/responses":
        body = {k: v for k, v in body.items() if k != "max_tokens"} | {"max_output_tokens": 16}
    raw = orjson.dumps(body)
    hashes = hasher.hashes(path, raw)

    async def serve() -> dict:
        assert engine.reset_prefix_cache()
        async with client.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    reply = run(serve())
    usage = reply["usage"]
    prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
    assert len(hashes) == prompt_tokens // hasher.info.block_size > 1
    cached = set(engine.cached_prefix_hashes())
    assert set(hashes) <= cached  # every hash names a block the engine holds for this prompt
    assert len(cached - set(hashes)) <= 1  # at most the block the output token completed


def test_unreadable_bodies_get_no_hashes(served):
    _, _, hasher, _ = served
    assert hasher.hashes("/v1/chat/completions", b"{not json") == []
    assert hasher.hashes("/v1/chat/completions", b"[1, 2]") == []
    assert hasher.hashes("/v1/chat/completions", orjson.dumps({"messages": "nope"})) == []
    assert hasher.hashes("/v1/completions", orjson.dumps({"prompt": ["a", "b"]})) == []  # two requests
    assert hasher.hashes("/v1/embeddings", orjson.dumps({"input": LONG})) == []
    short = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    assert len(hasher.hashes("/v1/chat/completions", short)) == 1  # the template alone fills a block


def test_a_conversations_next_turn_extends_its_hashes(served):
    _, _, hasher, _ = served
    turn1 = [{"role": "user", "content": LONG}]
    turn2 = [*turn1, {"role": "assistant", "content": "A river."}, {"role": "user", "content": LONG}]
    h1 = hasher.hashes("/v1/chat/completions", orjson.dumps({"messages": turn1}))
    h2 = hasher.hashes("/v1/chat/completions", orjson.dumps({"messages": turn2}))
    assert len(h2) > len(h1) > 1
    assert h2[: len(h1) - 1] == h1[:-1]  # the last block of turn 1 may hold the generation prompt
