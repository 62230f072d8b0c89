"""--reasoning-parser openai_gptoss: gpt-oss's harmony output (analysis channel, then final) split into
reasoning and answer, whole or streamed in any cut; over the chat and Messages routes with the special
tokens decoded for it; the think-block tools it cannot serve are refused with the route's 400."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, Generator
from typing import Any

import aiohttp
import pytest

from aioengine.http.app import bound_port, build_app, start_server
from aioengine.http.reasoning import HarmonyParser, split
from aioengine.outputs import CompletionOutput, RequestOutput
from tests.http.fake_engine import FakeEngine
from tests.http.test_named_stream_errors import ChatTokenizer

HARMONY = (
    "<|channel|>analysis<|message|>The user wants the capital. It is Paris.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The capital is <b>Paris</b>."
)
MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>", "<|constrain|>")
CALL = (
    "<|channel|>analysis<|message|>The user wants the weather: call the tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
TEXTS = {
    HARMONY: ("The user wants the capital. It is Paris.", "The capital is <b>Paris</b>."),
    HARMONY + "<|return|>": ("The user wants the capital. It is Paris.", "The capital is <b>Paris</b>."),
    "<|channel|>final<|message|>Just 4.<|return|>": (None, "Just 4."),
    # a commentary preamble is answer text; a header cut short has no text of its own
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>fin": (None, "Checking."),
    "<|channel|>analysis<|message|>cut short, 1 < 2": ("cut short, 1 < 2", ""),
    "No harmony at all <|end|>": (None, "No harmony at all <|end|>"),
    "": (None, ""),
}


@pytest.mark.parametrize("text", list(TEXTS))
def test_harmony_splits_the_same_whole_or_cut_anywhere(text):
    assert split("openai_gptoss", text) == TEXTS[text]
    rng = random.Random(len(text))
    for _ in range(60):
        parser, got_r, got_c, i = HarmonyParser(), "", "", 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 6))
            r, c = parser.feed(text[i:j])
            got_r, got_c, i = got_r + r, got_c + c, j
        r, c = parser.flush()
        assert ((got_r + r) if parser.reasoned else None, got_c + c) == TEXTS[text], text


class _Handle:
    """Streams ``pieces`` as deltas; awaited, the whole text (as the engine's handle does)."""

    def __init__(self, rid: str, pieces: list[str]) -> None:
        self.request_id = rid
        self.pieces = pieces

    def _out(self, text: str, last: bool) -> RequestOutput:
        done = CompletionOutput(0, text, [7], "stop" if last else None)
        return RequestOutput(self.request_id, "p", [1, 2], [done], finished=last)

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        async def it() -> AsyncGenerator[RequestOutput, None]:
            for k, piece in enumerate(self.pieces):
                yield self._out(piece, k == len(self.pieces) - 1)

        return it()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        async def whole() -> RequestOutput:
            return self._out("".join(self.pieces), True)

        return whole().__await__()


class HarmonyEngine(FakeEngine):
    """Writes HARMONY in small pieces; its special tokens are text only when the request keeps them (as
    a tokenizer's decode does); records each request's sampling params."""

    def __init__(self, script: str = HARMONY) -> None:
        super().__init__()
        self.tokenizer = ChatTokenizer(self.vocab_size)
        self.seen: list = []
        self.script = script

    def chat(
        self, messages, sampling_params=None, request_id=None, priority=0, chat_template_kwargs=None, **kw
    ):
        self.seen.append(sampling_params)
        text = self.script
        if sampling_params.skip_special_tokens:
            for marker in MARKERS:
                text = text.replace(marker, "")
        return _Handle(request_id or "r", [text[i : i + 5] for i in range(0, len(text), 5)])


def _run(engine, *requests: tuple[str, dict]) -> list[tuple[int, str]]:
    async def main():
        runner = await start_server(build_app(engine, reasoning_parser="openai_gptoss"), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                out = []
                for path, body in requests:
                    async with s.post(f"http://127.0.0.1:{bound_port(runner)}{path}", json=body) as r:
                        out.append((r.status, await r.text()))
                return out
        finally:
            await runner.cleanup()

    return asyncio.run(main())


ASK = [{"role": "user", "content": "The capital of France?"}]


def test_chat_and_messages_split_the_channels_streamed_or_not():
    import orjson

    engine = HarmonyEngine()
    chat = {"model": "fake", "messages": ASK}
    msgs = {"model": "fake", "max_tokens": 32, "messages": ASK}
    (s1, whole), (s2, streamed), (s3, message) = _run(
        engine,
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", chat | {"stream": True}),
        ("/v1/messages", msgs),
    )
    assert (s1, s2, s3) == (200, 200, 200), (whole, streamed, message)
    assert all(p.skip_special_tokens is False for p in engine.seen)  # the markup reaches the parser
    m = orjson.loads(whole)["choices"][0]["message"]
    reasoning, answer = TEXTS[HARMONY]
    assert (m["reasoning_content"], m["content"]) == (reasoning, answer)
    deltas = [
        orjson.loads(line[6:])["choices"] for line in streamed.splitlines() if line.startswith("data: {")
    ]
    got = {"reasoning_content": "", "content": ""}
    for choices in deltas:
        for key in got:
            got[key] += (choices[0]["delta"].get(key) or "") if choices else ""
    assert (got["reasoning_content"], got["content"]) == (reasoning, answer)
    blocks = orjson.loads(message)["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == (reasoning, answer)


def test_what_harmony_cannot_serve_gets_the_routes_400():
    import orjson

    engine = HarmonyEngine()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = {"model": "fake", "messages": ASK, "tools": [tool], "tool_choice": "required"}
    ((s0, body0),) = _run(engine, ("/v1/chat/completions", forced))
    assert s0 == 400 and orjson.loads(body0)["error"]["param"] == "tool_choice"  # a grammar over the markup
    (s1, body1), (s2, body2), (s3, body3) = _run(
        engine,
        ("/v1/chat/completions", {"model": "fake", "messages": ASK, "response_format": schema}),
        ("/v1/chat/completions", {"model": "fake", "messages": ASK, "thinking_token_budget": 8}),
        (
            "/v1/messages",
            {
                "model": "fake",
                "max_tokens": 64,
                "messages": ASK,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
        ),
    )
    assert (s1, s2, s3) == (400, 400, 400), (body1, body2, body3)
    assert "structured outputs are not supported" in orjson.loads(body1)["error"]["message"]
    assert orjson.loads(body2)["error"]["param"] == "thinking_token_budget"
    assert orjson.loads(body3)["type"] == "error"  # Anthropic's shape
    assert engine.seen == []


def test_a_call_to_functions_comes_back_as_tool_calls_in_chat_and_messages():
    import orjson

    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
    chat = {"model": "fake", "messages": ASK, "tools": [tool]}
    anthropic_tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    msgs = {"model": "fake", "max_tokens": 64, "messages": ASK, "tools": [anthropic_tool]}
    (s1, whole), (s2, streamed), (s3, message) = _run(
        HarmonyEngine(CALL),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", chat | {"stream": True}),
        ("/v1/messages", msgs),
    )
    assert (s1, s2, s3) == (200, 200, 200), (whole, streamed, message)
    choice = orjson.loads(whole)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["reasoning_content"] == "The user wants the weather: call the tool."
    chunks = [orjson.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    calls = [c for ch in chunks for x in ch["choices"] for c in x["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    blocks = orjson.loads(message)["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[1]["input"] == {"city": "Paris"}
    assert orjson.loads(message)["stop_reason"] == "tool_use"
