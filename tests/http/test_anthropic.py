"""Anthropic's Messages API through the official anthropic client against the live server (default model):
replies, streaming events, system prompts and turns, stop sequences, tools (forced and any, streamed or
not, tool results in the history), count_tokens, Anthropic's error shape and its x-api-key auth."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

ASK = [{"role": "user", "content": "What is the capital of France?"}]
# Current clients no longer take temperature, top_p or top_k as arguments; the API still does.
GREEDY = {"temperature": 0}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": CITY},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}}},
]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url(), api_key="unused", max_retries=0, timeout=60.0)


def test_a_message_answers_paris_with_usage_and_end_turn_or_max_tokens(claude, server, client):
    m = claude.messages.create(model="default", max_tokens=20, messages=ASK, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "default" and m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    chat = client.chat.completions.create(model="default", messages=ASK, temperature=0, max_tokens=20)
    assert m.content[0].text == chat.choices[0].message.content  # the same request underneath
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert server.wait_idle()["unfinished"] == 0


def test_the_stream_is_anthropics_event_sequence_and_adds_up_to_the_message(claude, http):
    full = claude.messages.create(model="default", max_tokens=12, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model="default", max_tokens=12, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason and final.usage.output_tokens == full.usage.output_tokens
    # The wire itself: each event named, in Anthropic's order
    r = http.post("/v1/messages", json={"max_tokens": 12, "messages": ASK, "stream": True, **GREEDY})
    assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in r.body.decode().split("\n\n"):
        if chunk.strip():
            name, data = chunk.split("\n", 1)
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    kinds = [k for k, _ in events]
    assert all(k == d["type"] for k, d in events)
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"} and len(kinds[3:-3]) >= 2  # really streamed
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["usage"]["input_tokens"] == full.usage.input_tokens
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text == full.content[0].text and delta["delta"]["stop_reason"] == full.stop_reason
    assert delta["usage"]["output_tokens"] == full.usage.output_tokens


def test_system_turns_and_stop_sequences(claude):
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "Count from 1 to 10, separated by commas."}]},
    ]
    m = claude.messages.create(
        model="default",
        max_tokens=40,
        system=[{"type": "text", "text": "You are terse."}],
        messages=turns,
        extra_body=GREEDY,
        stop_sequences=["5"],
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5"
    plain = claude.messages.create(
        model="default", max_tokens=40, system="You are terse.", messages=turns, extra_body=GREEDY
    )
    assert "5" in plain.content[0].text  # the same greedy reply, cut where the stop sequence begins
    assert m.content[0].text == plain.content[0].text[: plain.content[0].text.index("5")]


def test_a_forced_tool_is_a_tool_use_block_that_validates_streamed_or_not(claude):
    kwargs = dict(
        model="default",
        max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    m = claude.messages.create(**kwargs)
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, CITY)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == "get_weather" and streamed.input == block.input


def test_any_tool_ends_with_tool_use_and_a_tool_result_continues_the_turn(claude):
    m = claude.messages.create(
        model="default",
        max_tokens=80,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    calls = [b for b in m.content if b.type == "tool_use"]
    assert calls and m.stop_reason == "tool_use" and {c.name for c in calls} <= {"get_weather", "get_time"}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [c.model_dump() for c in calls]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": c.id, "content": "18 C and sunny"} for c in calls
            ],
        },
    ]
    follow = claude.messages.create(
        model="default", max_tokens=16, messages=history, tools=TOOLS, extra_body=GREEDY
    )
    assert follow.content and follow.content[0].type == "text" and follow.content[0].text


def test_count_tokens_is_the_prompt_the_message_would_use(claude):
    counted = claude.messages.count_tokens(model="default", messages=ASK, system="Be brief.")
    m = claude.messages.create(
        model="default", max_tokens=1, messages=ASK, system="Be brief.", extra_body=GREEDY
    )
    assert counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5


@pytest.mark.parametrize(
    "body, status, kind, word",
    [
        ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 5}, 400, "invalid_request_error", "messages"),
        (
            {"max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
            400,
            "invalid_request_error",
            "role",
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            None,
            "image",
        ),
        ({"max_tokens": -1, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"max_tokens": 5, "messages": ASK, "model": "nope"}, 404, "not_found_error", "nope"),
        ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "maybe"}}, 400, None, "tool_choice"),
        ({"max_tokens": 5, "messages": ASK, "stop_sequences": "x"}, 400, None, "stop_sequences"),
    ],
)
def test_bad_requests_get_anthropics_error_shape(http, body, status, kind, word):
    r = http.post("/v1/messages", json=body)
    assert r.status == status, r.body[:300]
    err = r.json()
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert err["error"]["type"] == (kind or "invalid_request_error") and word in err["error"]["message"]


def test_the_client_raises_typed_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=5, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="default", max_tokens=5, messages=[{"role": "user", "content": []}])


def test_x_api_key_authenticates_and_a_wrong_one_is_an_authentication_error(server):
    from tests.http.conftest import API_KEY

    ok = anthropic.Anthropic(base_url=server.url("keyed"), api_key=API_KEY, max_retries=0)
    assert ok.messages.create(model="default", max_tokens=2, messages=ASK).usage.output_tokens == 2
    wrong = anthropic.Anthropic(base_url=server.url("keyed"), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="default", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"


# A valid body's start: the cases add one bad field to it (OK + b"}" is valid).
OK = b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]'
TURN = b'{"max_tokens": 5, "messages": [{"role": "%s", "content": [%s]}]}'
HOSTILE = [
    b"not json",
    b"[1, 2]",
    b'"a string"',
    b"{}",
    b'{"max_tokens": "5", "messages": []}',
    b'{"max_tokens": 5, "messages": "hi"}',
    b'{"max_tokens": 5, "messages": [{"role": "user"}]}',
    TURN % (b"user", b'{"type": "text"}'),
    TURN % (b"user", b'{"type": "tool_use", "id": "x", "name": "f"}'),
    TURN % (b"assistant", b'{"type": "tool_use", "id": 1}'),
    TURN % (b"user", b'{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image"}]}'),
    OK + b', "system": 7}',
    OK + b', "system": [{"type": "image"}]}',
    OK + b', "tools": {"name": "f"}}',
    OK + b', "tools": [{"name": "f"}]}',
    OK + b', "tools": [{"type": "web_search_20250305", "name": "w"}]}',
    OK + b', "tool_choice": {"type": "tool"}}',
    OK + b', "metadata": [1]}',
    OK + b', "temperature": "hot"}',
    OK + b', "top_k": 1e999}',
    b'{"max_tokens": 1e999, "messages": [{"role": "user", "content": "x"}]}',
    OK + b', "mcp_servers": []}',
    b'{"max_tokens": 5, "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_are_4xx_in_anthropics_shape_and_leave_nothing_running(http, server, path, body):
    r = http.request("POST", path, body=body)
    assert 400 <= r.status < 500, (r.status, r.body[:300])
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"].endswith("_error") and err["error"]["message"]
    assert server.wait_idle()["unfinished"] == 0
