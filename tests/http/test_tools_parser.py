"""Tool calling's parsing pieces without a server: validation, the forcing schemas, and the text -> calls
parser, whole and streamed in arbitrary pieces."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from aioengine.http.errors import APIError
from aioengine.http.schema import SchemaContext
from aioengine.http.tools import (
    TOOL_CALLS,
    StreamParser,
    ToolError,
    extract,
    parse_tools,
    template_tool_calls,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "now"}}


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ("x", None, "tools"),
        ([{"type": "retrieval"}], None, "tools[0].type"),
        ([{"type": "function"}], None, "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "colour": 1}}], None, "tools[0].function.colour"),
        ([WEATHER, WEATHER], None, "tools[1].function.name"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice.function"),
        ([WEATHER], {"type": "function", "function": {"name": 3}}, "tool_choice.function.name"),
        ([WEATHER], 7, "tool_choice"),
        (None, "required", "tool_choice"),
        ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    ],
)
def test_bad_tool_fields_name_the_field(tools, choice, param):
    with pytest.raises(ToolError) as e:
        parse_tools(tools, choice, None)
    assert e.value.param == param


def test_no_tools_is_no_spec_and_auto_is_the_default():
    assert parse_tools(None, None, None) is None and parse_tools([], "none", None) is None
    spec = parse_tools([WEATHER, TIME], None, None)
    assert spec.choice == "auto" and spec.structured_outputs() is None
    assert spec.schemas["get_time"] == {"type": "object", "properties": {}}  # parameters may be omitted


def test_required_schema_takes_exactly_the_calls_it_should():
    schema = parse_tools([WEATHER, TIME], "required", None).structured_outputs()["json"]
    jsonschema.validate(
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}],
        schema,
    )
    for wrong in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = parse_tools([WEATHER, TIME], "required", False).structured_outputs()["json"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)


def test_named_choice_forces_that_functions_parameters():
    spec = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert spec.structured_outputs()["json"] == WEATHER["function"]["parameters"]
    content, calls, reason = extract(spec, '{"city": "Oslo"}', "stop")
    assert content is None and reason == "stop"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_required_output_becomes_calls():
    spec = parse_tools([WEATHER, TIME], "required", None)
    content, calls, reason = extract(
        spec,
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]',
        "stop",
    )
    assert content is None and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert len({c["id"] for c in calls}) == 2
    assert extract(spec, '[{"name": "get_ti', "length") == ('[{"name": "get_ti', [], "length")


AUTO_TEXTS = [
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Rome"}}</tool_call>',
    "No tools needed: 2 < 3 and <b>bold</b> <tool_ is not a tag.",
    "Broken <tool_call>{not json}</tool_call> stays text.",
    '<tool_call>{"name": "get_time", "arguments": {}}',  # cut short before the closing tag: still a call
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',  # Mistral
    '<|python_tag|>{"name": "get_time", "parameters": {}}',  # Llama 3
    '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
    '{"name": "unknown_tool", "parameters": {}}',  # not one of the tools: content
    ' {"answer": 42}',  # an ordinary JSON answer: content
    "[1, 2, 3] are numbers",
]


@pytest.mark.parametrize("text", AUTO_TEXTS)
def test_auto_streamed_in_any_pieces_equals_the_whole(text):
    spec = parse_tools([WEATHER, TIME], "auto", None)
    whole_content, whole_calls, whole_reason = extract(spec, text, "stop")
    rng = random.Random(len(text))
    for _ in range(20):
        parser, content, calls, cuts = StreamParser(spec), "", [], sorted(rng.sample(range(len(text)), 5))
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            delta = parser.delta(text[a:b]) or {}
            content += delta.get("content", "")
        last, reason = parser.finish("stop")
        content += (last or {}).get("content", "")
        calls = (last or {}).get("tool_calls", [])
        assert reason == whole_reason
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
        ]
        assert content.strip() == (whole_content or "").strip()
        if not whole_calls:
            assert content == text  # nothing lost, nothing added


def test_auto_parses_calls_and_keeps_the_text_before():
    spec = parse_tools([WEATHER], "auto", None)
    content, calls, reason = extract(spec, AUTO_TEXTS[0], "stop")
    assert content == "Let me check." and reason == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert extract(spec, AUTO_TEXTS[3], "stop") == (AUTO_TEXTS[3], [], "stop")


def test_history_tool_calls_reach_the_template_with_object_arguments():
    calls = template_tool_calls(
        [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    )
    assert calls == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    with pytest.raises(APIError) as e:
        TOOL_CALLS.check([{"id": "c1"}], "messages[1].tool_calls", SchemaContext())
    assert e.value.param == "messages[1].tool_calls[0].function"


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            [("get_weather", {"city": "Oslo"})],
        ),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}', [("get_time", {})]),
        (
            '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {}}',
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        ),
        ('{"name": "unknown_tool", "parameters": {}}', []),
        ('{"name": "get_time"}', []),  # no arguments: not a call
        ('{"answer": 42}', []),
    ],
)
def test_auto_knows_mistral_and_llama3_whole_output_calls(text, calls):
    spec = parse_tools([WEATHER, TIME], "auto", None)
    content, got, reason = extract(spec, text, "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert (content, reason) == ((None, "tool_calls") if calls else (text, "stop"))
