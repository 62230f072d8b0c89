"""Every API family reports the same ending the same way, streamed or not: plain text, a stop sequence, max
tokens, an auto tool call and a forced one, each through the official client (or the websocket), against
the live server. The output is pinned with a regex constraint so that each case is certain.

| case        | OpenAI chat  | Anthropic      | Responses                  | websocket   |
|-------------|--------------|----------------|----------------------------|-------------|
| text        | stop         | end_turn       | completed, a message       | stop        |
| stop string | stop         | stop_sequence  | completed                  | stop        |
| max tokens  | length       | max_tokens     | incomplete                 | length      |
| auto call   | tool_calls   | tool_use       | completed, a function_call | tool_calls  |
| forced call | stop (as OpenAI's API) | tool_use | completed, a function_call | stop      |
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import pytest

ASK = [{"role": "user", "content": "What time is it in London?"}]
TZ = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


def _regex(text: str) -> dict:
    escaped = "".join("\\" + ch if ch in ".{}[]()?*+|^$\\" else ch for ch in text)
    return {"structured_outputs": {"regex": escaped}, "temperature": 0}


# case -> (extra body, max tokens, stop strings, tool_choice ("auto" / "named" / None))
CASES = {
    "text": (_regex("It is noon."), 64, None, None),
    "stop": (_regex("It is noon. Bye."), 64, ["Bye"], None),
    "length": (_regex("It is noon, and the sun is high over the city."), 4, None, None),
    "auto_call": (_regex("Checking. " + CALL), 200, None, "auto"),
    "forced_call": ({"temperature": 0}, 200, None, "named"),
}
OPENAI = {
    "text": "stop",
    "stop": "stop",
    "length": "length",
    "auto_call": "tool_calls",
    "forced_call": "stop",
}
ANTHROPIC = {
    "text": "end_turn",
    "stop": "stop_sequence",
    "length": "max_tokens",
    "auto_call": "tool_use",
    "forced_call": "tool_use",
}
CALLS = {"auto_call", "forced_call"}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TZ}}]
ANTHROPIC_TOOLS = [{"name": "get_time", "input_schema": TZ}]


def _openai_kwargs(case: str) -> dict:
    body, max_tokens, stop, choice = CASES[case]
    kw: dict = {"model": "default", "messages": ASK, "max_tokens": max_tokens, "extra_body": body}
    if stop:
        kw["stop"] = stop
    if choice:
        kw["tools"] = OPENAI_TOOLS
        kw["tool_choice"] = (
            "auto" if choice == "auto" else {"type": "function", "function": {"name": "get_time"}}
        )
    return kw


@pytest.mark.parametrize("case", CASES)
def test_openai_chat(client, case):
    kw = _openai_kwargs(case)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == OPENAI[case]
    assert bool(choice.message.tool_calls) == (case in CALLS)
    streamed, called = None, False
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed = ch.finish_reason or streamed
            called = called or bool(ch.delta.tool_calls)
    assert streamed == OPENAI[case] and called == (case in CALLS)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=60.0)


@pytest.mark.parametrize("case", CASES)
def test_anthropic_messages(claude, case):
    body, max_tokens, stop, choice = CASES[case]
    kw: dict = {"model": "default", "messages": ASK, "max_tokens": max_tokens, "extra_body": body}
    if stop:
        kw["stop_sequences"] = stop
    if choice:
        kw["tools"] = ANTHROPIC_TOOLS
        kw["tool_choice"] = {"type": "auto"} if choice == "auto" else {"type": "tool", "name": "get_time"}
    m = claude.messages.create(**kw)
    assert m.stop_reason == ANTHROPIC[case]
    assert any(b.type == "tool_use" for b in m.content) == (case in CALLS)
    assert m.stop_sequence == ("Bye" if case == "stop" else None)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == ANTHROPIC[case]
    assert any(b.type == "tool_use" for b in final.content) == (case in CALLS)


@pytest.mark.parametrize("case", [c for c in CASES if c != "stop"])  # the Responses API has no stop strings
def test_responses(client, case):
    body, max_tokens, _stop, choice = CASES[case]
    kw: dict = {"model": "default", "input": ASK, "max_output_tokens": max_tokens, "extra_body": body}
    if choice:
        kw["tools"] = [{"type": "function", "name": "get_time", "parameters": TZ}]
        kw["tool_choice"] = "auto" if choice == "auto" else {"type": "function", "name": "get_time"}
    status = "incomplete" if case == "length" else "completed"
    r = client.responses.create(**kw)
    assert r.status == status
    assert any(item.type == "function_call" for item in r.output) == (case in CALLS)
    final = None
    for event in client.responses.create(stream=True, **kw):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.status == status
    assert any(item.type == "function_call" for item in final.output) == (case in CALLS)


@pytest.mark.parametrize("case", CASES)
def test_websocket(server, case):
    body = {k: v for k, v in _openai_kwargs(case).items() if k != "extra_body"} | CASES[case][0]

    async def main() -> dict:
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url() + "/v1/ws") as ws:
            await ws.send_json({"type": "chat", "id": "f", "body": body})
            while True:
                msg = await asyncio.wait_for(ws.receive_json(), 60)
                if msg["type"] not in ("start", "delta"):
                    return msg

    end = asyncio.run(main())
    assert end["type"] == "done", end
    choice = end["choices"][0]
    assert choice["finish_reason"] == OPENAI[case]
    assert bool(choice.get("tool_calls")) == (case in CALLS)
    if case == "auto_call":
        assert [json.loads(c["function"]["arguments"]) for c in choice["tool_calls"]] == [{"tz": "UTC"}]
