"""Tool calling through the official openai client against the live server (default model): forced calls
(named, required) validate against the tools' schemas, streamed or not; auto mode turns <tool_call> blocks
into calls; tool results in the history are accepted; bad tool fields are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
TZ = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TZ}},
]
SCHEMAS = {"get_weather": CITY, "get_time": TZ}
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _stream(client, **kw):
    """(finish_reason, content, {index: (id, name, arguments)}) from a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, stream=True, **kw
    ):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                cid, name, args = calls.get(tc.index, (None, "", ""))
                calls[tc.index] = (
                    tc.id or cid,
                    name + (tc.function.name or ""),
                    args + (tc.function.arguments or ""),
                )
            finish = ch.finish_reason or finish
    return finish, content, calls


def test_named_tool_choice_returns_a_valid_call(client):
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice=FORCED, temperature=0, max_tokens=60
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None  # OpenAI's answer to a forced call
    _check_calls(c.message.tool_calls, {"get_weather"})
    finish, content, calls = _stream(client, tool_choice=FORCED, temperature=0, max_tokens=60)
    assert finish == "stop" and content == ""
    ((cid, name, args),) = calls.values()
    assert name == "get_weather" and args == c.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_returns_valid_calls(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model="default",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
        max_tokens=80,
        **extra,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls)
    if parallel is False:
        assert len(c.message.tool_calls) == 1
    finish, content, calls = _stream(client, tool_choice="required", temperature=0, max_tokens=80, **extra)
    assert finish == "tool_calls" and content == ""
    assert [(n, a) for _, n, a in calls.values()] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls
    ]


def test_auto_turns_tool_call_blocks_into_calls(client):
    # The model is made to write a Hermes-style block (a regex constraint), as Qwen-family models do.
    block = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    regex = "Checking\\. " + block.replace("{", "\\{").replace("}", "\\}")
    body = {"structured_outputs": {"regex": regex}}
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, temperature=0, max_tokens=300, extra_body=body
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    _check_calls(c.message.tool_calls, {"get_time"})
    finish, content, calls = _stream(client, temperature=0, max_tokens=300, extra_body=body)
    assert finish == "tool_calls" and content.strip() == "Checking." and "<tool" not in content
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_time", {"tz": "UTC"})]


def test_auto_without_a_call_is_plain_content(client):
    plain = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=12)
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=12
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    none = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12
    )
    assert none.choices[0].message.content == plain.choices[0].message.content  # this template ignores tools
    finish, content, calls = _stream(client, temperature=0, max_tokens=12)
    assert content == r.choices[0].message.content and not calls and finish == r.choices[0].finish_reason


def test_tool_results_in_the_history(client):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="default", messages=history, tools=TOOLS, temperature=0, max_tokens=10
    )
    assert r.choices[0].message.content and r.usage.prompt_tokens > 30


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "string", "pattern": "(unclosed"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ],
)
def test_bad_tool_fields_are_400s(client, kw, param):
    kw = {"messages": ASK, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", max_tokens=5, **kw)
    assert e.value.body["param"] == param


def test_websocket_done_message_carries_the_calls(server):
    import asyncio

    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url() + "/v1/ws") as ws:
            await ws.send_json(
                {
                    "type": "chat",
                    "id": "t",
                    "body": {
                        "messages": ASK,
                        "tools": TOOLS,
                        "tool_choice": "required",
                        "temperature": 0,
                        "max_tokens": 80,
                    },
                }
            )
            texts, end = [], None
            while end is None:
                msg = await asyncio.wait_for(ws.receive_json(), 60)
                if msg["type"] == "delta":
                    texts.append(msg["text"])
                elif msg["type"] != "start":
                    end = msg
            return "".join(texts), end

    text, end = asyncio.run(main())
    choice = end["choices"][0]
    assert end["type"] == "done" and choice["finish_reason"] == "tool_calls" and choice["content"] is None
    assert [
        {"name": c["function"]["name"], "parameters": json.loads(c["function"]["arguments"])}
        for c in choice["tool_calls"]
    ] == json.loads(text)  # the deltas are the raw forced JSON
