"""An engine that dies mid-stream ends Anthropic's and the Responses API's streams with their own named
error event (`event: error`), as the last bytes of a body that then ends: no [DONE], which neither API
sends."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from aioengine.http.app import bound_port, build_app, start_server
from tests.http.fake_engine import FakeEngine, FakeTokenizer


class ChatTokenizer(FakeTokenizer):
    chat_template = "one token a character"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return self.encode("".join(str(m.get("content", "")) for m in messages))


ROUTES = {
    "/v1/messages": {
        "model": "fake",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    },
    "/v1/responses": {"model": "fake", "input": "x", "stream": True},
}


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_dead_engine_ends_a_named_event_stream_with_its_error_event(path):
    async def main() -> str:
        engine = FakeEngine()
        engine.tokenizer = ChatTokenizer(engine.vocab_size)
        runner = await start_server(build_app(engine), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(f"http://127.0.0.1:{bound_port(runner)}{path}", json=ROUTES[path])
                assert resp.status == 200, await resp.text()
                seen = b""
                while b"Hello" not in seen:  # the fake's one token is out: the stream is under way
                    line = await asyncio.wait_for(resp.content.readline(), 10)
                    assert line, seen
                    seen += line
                engine.die()
                return (seen + await asyncio.wait_for(resp.read(), 10)).decode()
        finally:
            await runner.cleanup()

    body = asyncio.run(main())
    assert body.endswith("\n\n") and "[DONE]" not in body
    name, data = body.rstrip("\n").split("\n\n")[-1].split("\n")
    err = orjson.loads(data.removeprefix("data: "))
    assert name == "event: error" and err["type"] == "error", body[-400:]
    message = err["error"]["message"] if path == "/v1/messages" else err["message"]
    assert "boom" in message
