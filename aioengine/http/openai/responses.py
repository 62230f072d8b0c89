"""POST /v1/responses: OpenAI's Responses API. The request becomes a chat request (admitted and run as
/v1/chat/completions runs one), its output a `response` object, or a stream of `response.*` events.

Supported: `input` (a string, or message, function_call and function_call_output items; text content),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format` (text, json_object,
json_schema), `reasoning.effort`, function `tools` with `tool_choice` and `parallel_tool_calls` (calls come
back as function_call items), `user`, `metadata`. Nothing is stored, so `previous_response_id` and
`background` are refused. `store` is accepted and unused.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.chat_output import ChatOutputParser, Content, Reasoning, parse_whole
from aioengine.http.context import CONFIG, ENGINE, json_response
from aioengine.http.errors import APIError, bad, not_supported
from aioengine.http.messages import content_text
from aioengine.http.openai.chat import CHAT, parse_chat_request
from aioengine.http.openai.response_object import ResponseBuilder
from aioengine.http.request_tables import (
    JSON_SCHEMA_FIELDS,
    MAX_TOKENS_NOTE,
    REASONING_EFFORTS,
    SAMPLING,
    STR_SCHEMA,
    TEXT_VALUE,
    metadata_spec,
    sampled,
)
from aioengine.http.schema import Fields, SchemaContext, Spec, Table, object_schema
from aioengine.http.shapes import Array, Either, Obj, Tagged, Value
from aioengine.http.streaming import JSON, SSEWriter, Tally, guarded_sse, merged


async def responses(request: web.Request) -> web.StreamResponse:
    data, adm = await admission.admit_translated(request, to_chat_body, parse_chat_request, "resp")
    handle = admission.start_chat(request.app, adm, f"response, {len(adm.req.messages)} messages")
    builder = ResponseBuilder(data, adm.request_id, adm.model)
    engine = request.app[ENGINE]
    parser = request.app[CONFIG].reasoning_parser
    if adm.req.stream:
        output = ChatOutputParser(parser, adm.req.tools)
        return await stream_response(request, engine, handle, adm.request_id, builder, output)
    out = await handle
    c = out.outputs[0]
    # the think block becomes a reasoning item before the message; calls become function_call items after it
    parsed = parse_whole(parser, adm.req.tools, c.text, c.finish_reason)
    builder.reasoning, builder.calls = parsed.reasoning, parsed.tool_calls
    return json_response(
        builder.response("completed", parsed.content or "", parsed.finish_reason, Tally.of([out]).usage()),
        headers={"X-Request-Id": adm.request_id},
    )


async def stream_response(
    request: web.Request,
    engine: EngineClient,
    handle: RequestHandle,
    request_id: str,
    builder: ResponseBuilder,
    output: ChatOutputParser,
) -> web.StreamResponse:
    """The Responses API's events: created; with a reasoning parser, the reasoning item and its text deltas
    first; the message item and its text part opening, one text delta per engine delta, then the closing
    events and `response.completed` (or `response.incomplete`) with usage."""
    tally = Tally([0], [0])

    async def write(sse: SSEWriter) -> None:
        text, thought, finish, opened = "", "", None, False

        async def open_message() -> None:
            nonlocal opened
            if opened:
                return
            opened = True
            if builder.reasoning is not None:  # the reasoning item closes before the message opens
                builder.reasoning = thought
                done = builder.reasoning_item("completed")
                await sse.send_event(builder.reasoning_event("response.reasoning_text.done", text=thought))
                await sse.send_event(builder.event("response.output_item.done", output_index=0, item=done))
            await sse.send_event(
                builder.event(
                    "response.output_item.added",
                    output_index=builder.message_index,
                    item=builder.message(None, "in_progress"),
                )
            )
            await sse.send_event(builder.text_event("response.content_part.added", part=builder.part("")))

        await sse.send_event(builder.event("response.created", response=builder.response("in_progress")))
        await sse.send_event(builder.event("response.in_progress", response=builder.response("in_progress")))
        if output.thinker is None and output.calls is None:
            await open_message()
        async with aclosing(merged([handle])) as deltas:
            async for i, out in deltas:
                tally.add(i, out)
                c = out.outputs[0]
                events = output.feed(c.text)
                if c.finish_reason is not None:
                    events += output.finish(c.finish_reason)
                    finish = output.finish_reason
                if output.reasoned and builder.reasoning is None:  # a think block opened
                    builder.reasoning = ""
                    item = builder.reasoning_item("in_progress")
                    await sse.send_event(
                        builder.event("response.output_item.added", output_index=0, item=item)
                    )
                reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
                if reasoning:
                    thought += reasoning
                    await sse.send_event(
                        builder.reasoning_event("response.reasoning_text.delta", delta=reasoning)
                    )
                piece = "".join(e.text for e in events if isinstance(e, Content))
                if piece:
                    await open_message()
                    text += piece
                    await sse.send_event(
                        builder.text_event("response.output_text.delta", delta=piece, logprobs=[])
                    )
        builder.calls = output.tool_calls
        if text or not builder.calls:
            await open_message()
        if opened:
            await sse.send_event(builder.text_event("response.output_text.done", text=text, logprobs=[]))
            await sse.send_event(builder.text_event("response.content_part.done", part=builder.part(text)))
        elif builder.reasoning is not None:  # calls only: the reasoning item still closes
            builder.reasoning = thought
            await sse.send_event(builder.reasoning_event("response.reasoning_text.done", text=thought))
            done = builder.reasoning_item("completed")
            await sse.send_event(builder.event("response.output_item.done", output_index=0, item=done))
        final = builder.response("completed", text, finish, tally.usage())
        if opened:
            index = builder.message_index
            await sse.send_event(
                builder.event("response.output_item.done", output_index=index, item=final["output"][index])
            )
        for index, item in builder.call_items(final):  # each call: added, its arguments, done
            await sse.send_event(
                builder.event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
            )
            args = {"item_id": item["id"], "output_index": index}
            await sse.send_event(
                builder.event("response.function_call_arguments.delta", **args, delta=item["arguments"])
            )
            await sse.send_event(
                builder.event("response.function_call_arguments.done", **args, arguments=item["arguments"])
            )
            await sse.send_event(builder.event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        await sse.done_named(builder.event(kind, response=final))

    async def write_error(sse: SSEWriter, err: APIError) -> None:
        await sse.done_named(builder.event("error", code=err.code, message=err.message, param=None))

    return await guarded_sse(request, engine, [handle], request_id, write, write_error)


# ---- the request: a chat-completions body ------------------------------------------------------------------


def to_chat_body(data: JSON) -> JSON:
    """The chat-completions body this Responses request asks for (then parsed by parse_chat_request)."""
    f = Fields(data, RESPONSE)
    for name, what in (
        ("previous_response_id", "previous_response_id (nothing is stored)"),
        ("background", "background responses"),
    ):
        if f.data.get(name) not in (None, False):
            raise not_supported(name, what)
    tools = f.get("tools", list)
    choice = f.data.get("tool_choice")
    if f.get("include", list):
        raise not_supported("include")
    f.str("truncation")  # disabled or auto (the spec's choices): nothing to truncate either way
    if f.int("top_logprobs", 0):
        raise not_supported("top_logprobs", "top_logprobs on /v1/responses")
    f.bool("store")
    f.bool("parallel_tool_calls")
    messages = _messages(data.get("input"))
    instructions = f.str("instructions")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    body: dict[str, Any] = {"messages": messages}
    if tools:  # the flat function tools as chat's
        for i, t in enumerate(tools):
            if isinstance(t, dict) and t.get("type") != "function":
                raise not_supported(
                    f"tools.{i}.type", f"Tools of type {t.get('type')!r} (only function tools)"
                )
            RESPONSE_TOOL.check(t, f"tools.{i}", SchemaContext())
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t["name"]),
                        ("description", t.get("description")),
                        ("parameters", t.get("parameters")),
                    )
                    if v is not None
                },
            }
            for t in tools
        ]
    if choice is not None:
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad(
                    "tool_choice must be none, auto, required or {type: function, name}.", "tool_choice"
                )
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            body["tool_choice"] = choice
    if data.get("parallel_tool_calls") is not None:
        body["parallel_tool_calls"] = data["parallel_tool_calls"]
    for src, dst in (
        ("model", "model"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("user", "user"),
        ("metadata", "metadata"),
        ("service_tier", "service_tier"),
        ("structured_outputs", "structured_outputs"),
    ):
        if data.get(src) is not None:
            body[dst] = data[src]
    text = f.get("text", dict)
    if text is not None:
        Fields(text, RESPONSE_TEXT, "text.")
        fmt = text.get("format")
        if fmt is not None:
            body["response_format"] = _response_format(fmt)
    reasoning = f.get("reasoning", dict)
    if reasoning is not None:
        rf = Fields(reasoning, RESPONSE_REASONING, "reasoning.")
        if rf.str("effort") is not None:
            body["reasoning_effort"] = rf.str("effort")
    return body


def _messages(raw: object) -> list[JSON]:
    if raw is None:
        raise bad("input is required.", "input")
    INPUT.check(raw, "input", SchemaContext())
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    assert isinstance(raw, list)
    out: list[JSON] = []
    for item in raw:
        kind = item.get("type", "message")
        if kind == "function_call":  # the model's earlier call: an assistant turn's tool call
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            out.append({"role": item["role"], "content": content_text(item["content"])})
    return out


def _response_format(fmt: object) -> JSON:
    TEXT_FORMAT.check(fmt, "text.format", SchemaContext())
    assert isinstance(fmt, dict)
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.get("name") or "response", "schema": fmt["schema"]},
    }


# ---- the request's fields (/openapi.json states them) ----------------------------------------------------
# Parts echoed back from an earlier output carry annotations and logprobs: any other keys are fine.
_INPUT_PART = Obj({"type": TEXT_VALUE, "text": TEXT_VALUE}, ("text",), open=True)


# The Responses API's function tool (flat: name and parameters beside the type).
RESPONSE_TOOL = Obj(
    {
        "type": Value(str, enum=("function",)),
        "name": TEXT_VALUE,
        "description": TEXT_VALUE,
        "parameters": Value(dict),
        "strict": Value(bool),
    },
    ("type", "name"),
)


_CALL_ITEM = Obj(
    {
        "type": TEXT_VALUE,
        "call_id": TEXT_VALUE,
        "name": TEXT_VALUE,
        "arguments": TEXT_VALUE,
        "id": TEXT_VALUE,
        "status": TEXT_VALUE,
    },
    ("call_id", "name", "arguments"),
)


_CALL_OUTPUT_ITEM = Obj(
    {
        "type": TEXT_VALUE,
        "call_id": TEXT_VALUE,
        "output": TEXT_VALUE,
        "id": TEXT_VALUE,
        "status": TEXT_VALUE,
    },
    ("call_id", "output"),
)


INPUT = Either(
    (
        TEXT_VALUE,
        Array(
            Tagged(
                "type",
                {
                    "message": Obj(
                        {
                            "type": TEXT_VALUE,
                            "role": Value(str, enum=("user", "assistant", "system", "developer")),
                            "content": Either(
                                (
                                    TEXT_VALUE,
                                    Array(
                                        Tagged(
                                            "type",
                                            {k: _INPUT_PART for k in ("input_text", "output_text", "text")},
                                            "Content parts of type {}",
                                        )
                                    ),
                                ),
                                "a string or an array of content parts",
                            ),
                            "id": TEXT_VALUE,
                            "status": TEXT_VALUE,
                        },
                        ("role", "content"),
                    ),
                    "function_call": _CALL_ITEM,
                    "function_call_output": _CALL_OUTPUT_ITEM,
                },
                "Input items of type {}",
                default="message",
            ),
            min_items=1,
            max_items=lambda limits: limits.max_messages,
            what="items",
        ),
    ),
    "a string or a non-empty array of message items",
)


TEXT_FORMAT = Tagged(
    "type",
    {
        "text": Obj({"type": TEXT_VALUE}),
        "json_object": Obj({"type": TEXT_VALUE}),
        "json_schema": Obj({"type": TEXT_VALUE, **JSON_SCHEMA_FIELDS}, ("schema",)),
    },
)


RESPONSE_TEXT: Table = {"format": Spec(None, schema=TEXT_FORMAT.schema), "verbosity": Spec(str)}


RESPONSE_REASONING: Table = {
    "effort": Spec(str, enum=REASONING_EFFORTS, checked_later=True),  # as the chat request's reasoning_effort
    "summary": Spec(None),
    "generate_summary": Spec(None),
}


RESPONSE: Table = {  # openai_responses.to_chat_body turns it into a CHAT body
    "model": Spec(str),
    "input": Spec(None, schema=INPUT.schema),
    "instructions": Spec(str),
    "max_output_tokens": sampled(int, "max_tokens", description=MAX_TOKENS_NOTE),
    "temperature": SAMPLING["temperature"],
    "keep_alive": SAMPLING["keep_alive"],
    "top_p": SAMPLING["top_p"],
    "stream": Spec(bool),
    "text": Spec(dict, schema=lambda ctx: object_schema(RESPONSE_TEXT, ctx)),
    "reasoning": Spec(dict, schema=lambda ctx: object_schema(RESPONSE_REASONING, ctx)),
    "user": Spec(str),
    "metadata": metadata_spec(),
    "store": Spec(bool, description="accepted; nothing is stored"),
    "tools": Spec(
        list, schema=lambda ctx: {"items": RESPONSE_TOOL.schema(ctx), "description": "function tools"}
    ),
    "tool_choice": Spec(
        None,
        schema={
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "properties": {"type": {"const": "function"}, "name": STR_SCHEMA}},
            ]
        },
    ),
    "parallel_tool_calls": Spec(bool),
    "truncation": Spec(str, enum=("disabled", "auto")),
    "include": Spec(list, schema={"maxItems": 0, "description": "not supported"}),
    "previous_response_id": Spec(
        None, schema={"const": False, "description": "not supported: nothing is stored"}
    ),
    "background": Spec(bool, schema={"const": False, "description": "not supported"}),
    "service_tier": CHAT["service_tier"],
    "top_logprobs": Spec(int, schema={"const": 0, "description": "not supported here"}),
    "structured_outputs": SAMPLING["structured_outputs"],  # vLLM's, as on the chat route
    "safety_identifier": Spec(str),
    "prompt_cache_key": Spec(str),
}


RESPONSE_REQUIRED = ("input",)
