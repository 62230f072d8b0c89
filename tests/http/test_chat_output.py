"""The one chat-output parser: the reasoning split and the tool calls give the same choice however the text
was cut into deltas, the whole case is the stream fed at once, and each finish reason is chat's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aioengine.http.chat_output import ChatOutputParser, Content, Reasoning, ToolCall, chat_delta, parse_whole
from aioengine.http.tools import parse_tools

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
PIECES = ["<think>", "</think>", "hmm ", "It is noon.", " ", CALL, "<tool", "_call>", "{", "}", '"x"']


def _stream(reasoning, tools, text, cuts, finish="stop"):
    parser = ChatOutputParser(reasoning, tools)
    events, at = [], 0
    for cut in sorted(cuts):
        events += parser.feed(text[at:cut])
        at = cut
    events += parser.feed(text[at:])
    events += parser.finish(finish)
    return parser, events


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=8),
    st.lists(st.integers(0, 400), max_size=6),
    st.sampled_from([None, "qwen3", "deepseek_r1"]),
    st.sampled_from([None, "auto", "required", "named"]),
)
def test_any_cut_gives_the_whole_parse(pieces, cuts, reasoning, choice):
    text = "".join(pieces)
    tools = None
    if choice is not None:
        named = {"type": "function", "function": {"name": "get_time"}}
        tools = parse_tools([TIME], named if choice == "named" else choice, None)
    parser, events = _stream(reasoning, tools, text, [c for c in cuts if c <= len(text)])
    whole = parse_whole(reasoning, tools, text, "stop")
    streamed = parser.result()
    assert (streamed.reasoning, streamed.content, streamed.finish_reason) == (
        whole.reasoning,
        whole.content,
        whole.finish_reason,
    )
    strip_ids = [{**c, "id": None} for c in streamed.tool_calls]
    assert strip_ids == [{**c, "id": None} for c in whole.tool_calls]
    # the events carry everything the result holds
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    assert thought == (streamed.reasoning or "")
    if not streamed.tool_calls:
        assert "".join(e.text for e in events if isinstance(e, Content)) == (streamed.content or "")


def test_reasoning_then_an_auto_call():
    tools = parse_tools([TIME], "auto", None)
    parsed = parse_whole("qwen3", tools, "<think>the user asks</think>Checking. " + CALL, "stop")
    assert parsed.reasoning == "the user asks" and parsed.content == "Checking."
    assert parsed.finish_reason == "tool_calls" and parsed.called
    assert [c["function"] for c in parsed.tool_calls] == [{"name": "get_time", "arguments": '{"tz": "UTC"}'}]


def test_a_forced_call_streams_its_arguments_and_keeps_chats_finish_reason():
    tools = parse_tools([TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    parser, events = _stream(None, tools, '{"tz": "CET"}', [3, 7])
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert calls[0].id is not None and calls[0].name == "get_time"
    assert all(e.id is None for e in calls[1:])
    assert "".join(e.arguments for e in calls) == '{"tz": "CET"}'
    assert parser.finish_reason == "stop" and parser.called  # OpenAI's own for a named tool_choice
    assert chat_delta(calls[:1])["tool_calls"][0]["function"]["name"] == "get_time"


def test_cut_short_keeps_length_and_no_tools_is_plain_text():
    tools = parse_tools([TIME], "auto", None)
    parsed = parse_whole(None, tools, "Checking. <tool_call>\n{", "length")
    assert parsed.finish_reason == "length" and not parsed.called
    assert parse_whole(None, None, "plain", "stop").content == "plain"
    assert parse_whole("deepseek_r1", None, "unfinished thought", "length").reasoning == "unfinished thought"
