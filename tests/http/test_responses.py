"""OpenAI's Responses API (/v1/responses) through the official openai client: the same text as a chat
completion of the same messages, streamed events in order, usage, truncation, and refusals."""

from __future__ import annotations

import json

import openai
import pytest

QUESTION = "What is the capital of France?"


def test_a_response_is_the_chat_completion_of_the_same_messages(client):
    r = client.responses.create(
        model="default", input=QUESTION, instructions="Answer briefly.", max_output_tokens=16, temperature=0
    )
    chat = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=16,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}],
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "default"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_message_items_and_text_parts(client):
    r = client.responses.create(
        model="default",
        temperature=0,
        max_output_tokens=16,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )
    plain = client.responses.create(model="default", temperature=0, max_output_tokens=16, input=QUESTION)
    assert r.output_text == plain.output_text


def test_streamed_events_add_up_to_the_response(client):
    whole = client.responses.create(model="default", input=QUESTION, max_output_tokens=16, temperature=0)
    events = list(
        client.responses.create(
            model="default", input=QUESTION, max_output_tokens=16, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


def test_truncation_is_incomplete_with_a_reason(client):
    r = client.responses.create(model="default", input="Tell me a long story.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_json_schema_format(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="default",
        input=QUESTION,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    assert set(json.loads(r.output_text)) == {"city"}


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        ({"input": [{"type": "file_search_call", "id": "c"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "o"}]}, "input[0].call_id"),
        ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            "input[0].content[0].type",
        ),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)
def test_what_it_cannot_do_is_a_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", **{"input": "hi", "max_output_tokens": 4, **kw})
    assert e.value.body["param"] == param


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_forced_function_comes_back_as_a_function_call_item_streamed_or_not(client):
    kwargs = dict(
        model="default",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    r = client.responses.create(**kwargs)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert [o.type for o in r.output] == ["function_call"]  # no empty message beside it
    assert r.tools[0].name == "get_weather"
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    assert done.arguments == call.arguments and done.output_index == 0
    final = events[-1].response
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].arguments == call.arguments


def test_a_function_call_and_its_output_continue_the_conversation(client):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"},
    ]
    r = client.responses.create(
        model="default", input=history, tools=[WEATHER], temperature=0, max_output_tokens=16
    )
    assert r.output[-1].type == "message" and r.output_text
    same = client.chat.completions.create(
        model="default",
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
        ],
        tools=[
            {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
        ],
        temperature=0,
        max_tokens=16,
    )
    assert r.output_text == same.choices[0].message.content  # the same conversation underneath


def test_auto_turns_a_tool_call_block_into_a_function_call_after_the_text(client):
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    regex = "Checking\\. " + block.replace("{", "\\{").replace("}", "\\}")
    kwargs = dict(
        model="default",
        input="Weather in Paris?",
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=300,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    r = client.responses.create(**kwargs)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking." and json.loads(r.output[1].arguments) == {"city": "Paris"}
    events = list(client.responses.create(**kwargs, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == "Checking." and "<tool" not in text
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == r.output[1].arguments
