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
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, "input[0].type"),
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
