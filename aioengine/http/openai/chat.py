"""POST /v1/chat/completions: admission, one engine request, then OpenAI's chat.completion JSON or its SSE
stream of chat.completion.chunk events (tool calls parsed out of the text when the request has tools)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.chat_output import ChatOutputParser, chat_delta, parse_whole
from aioengine.http.context import CONFIG, ENGINE, json_response
from aioengine.http.errors import bad, not_supported
from aioengine.http.logprobs import chat_logprobs, prompt_logprobs_json
from aioengine.http.messages import MESSAGES, TEMPLATE_KWARGS, parse_messages, template_kwargs
from aioengine.http.parsing import ChatRequest, generation_request, shaped
from aioengine.http.request_tables import (
    MAX_TOKENS_NOTE,
    METADATA,
    REASONING_EFFORTS,
    SAMPLING,
    metadata_spec,
    sampled,
)
from aioengine.http.schema import DEFAULT_LIMITS, Fields, RequestLimits, SchemaContext, Spec, Table
from aioengine.http.streaming import JSON, Tally, stream_choices
from aioengine.http.tools import TOOL_CHOICE, TOOLS, ToolError, parse_tools
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.sampling_params import StructuredOutputsParams


async def chat_completions(request: web.Request) -> web.StreamResponse:
    adm = await admission.admit_request(request, parse_chat_request, "chatcmpl")
    handle = admission.start_chat(request.app, adm, f"chat, {len(adm.req.messages)} messages")
    engine = request.app[ENGINE]
    reasoning = request.app[CONFIG].reasoning_parser
    if adm.req.stream:
        return await stream_chat(request, engine, adm, handle, reasoning)
    out = await handle
    return json_response(
        chat_completion(engine, adm, out, reasoning), headers={"X-Request-Id": adm.request_id}
    )


def chat_completion(
    engine: EngineClient, adm: Admitted[ChatRequest], out: RequestOutput, reasoning_parser: str | None = None
) -> JSON:
    """The chat.completion object of a finished request."""
    req, k = adm.req, adm.req.params.logprobs
    choices = []
    for c in out.outputs:
        parsed = parse_whole(reasoning_parser, req.tools, c.text, c.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        finish_reason = parsed.finish_reason
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": None if k is None else chat_logprobs(engine, c.token_ids, c.logprobs, k),
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    response = {
        "id": adm.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": adm.model,
        "choices": choices,
        "usage": Tally.of([out]).usage(),
    }
    if req.want_prompt_logprobs:  # vLLM's extra field, beside the choices
        response["prompt_logprobs"] = prompt_logprobs_json(engine, out.prompt_logprobs)
    return response


async def stream_chat(
    request: web.Request,
    engine: EngineClient,
    adm: Admitted[ChatRequest],
    handle: RequestHandle,
    reasoning_parser: str | None = None,
) -> web.StreamResponse:
    req, k = adm.req, adm.req.params.logprobs
    base = {
        "id": adm.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": adm.model,
    }
    parsers: dict[int, ChatOutputParser] = {}

    def choice(_i: int, c: CompletionOutput, _out: RequestOutput) -> JSON | None:
        # <think> text goes out as reasoning_content, apart; the rest may be (part of) a tool call
        parser = parsers.setdefault(c.index, ChatOutputParser(reasoning_parser, req.tools))
        events = parser.feed(c.text)
        finish_reason = None
        if c.finish_reason:
            events += parser.finish(c.finish_reason)
            finish_reason = parser.finish_reason
        delta = chat_delta(events)
        if not delta and not finish_reason and (k is None or not c.token_ids):
            return None  # a parser holds a piece that may still be a tag
        d = {
            "index": c.index,
            "delta": delta,
            "logprobs": None if k is None else chat_logprobs(engine, c.token_ids, c.logprobs, k),
            "finish_reason": finish_reason,
        }
        if finish_reason:
            d["stop_reason"] = c.stop_reason
        return d

    first = [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(req.params.n)
    ]
    return await stream_choices(request, engine, req, [handle], adm.request_id, base, first, choice)


# ---- the request: its fields (/openapi.json states them) and its parser --------------------------------
CHAT: Table = {
    **SAMPLING,
    "messages": Spec(None, schema=MESSAGES.schema),
    "max_tokens": sampled(int, "max_tokens", description=MAX_TOKENS_NOTE),
    "max_completion_tokens": sampled(int, "max_tokens", description=MAX_TOKENS_NOTE),
    "logprobs": Spec(bool),
    "top_logprobs": sampled(int, "logprobs", later=False, description="needs logprobs: true"),
    "chat_template_kwargs": Spec(None, schema=TEMPLATE_KWARGS.schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool, description="the last message must be the assistant's"),
    "tools": Spec(None, schema=TOOLS.schema),
    "tool_choice": Spec(None, schema=TOOL_CHOICE.schema),
    "parallel_tool_calls": Spec(bool),
    "store": Spec(None, schema={"const": False}),  # nothing is stored: true is refused
    "metadata": metadata_spec(),
    "reasoning_effort": Spec(str, enum=REASONING_EFFORTS),
    "thinking_token_budget": sampled(
        int, "thinking_token_budget", description="tokens in the think block; then </think> is forced"
    ),
    "service_tier": Spec(str, enum=("auto", "default"), checked_later=True),  # others: "not supported"
}


CHAT_REQUIRED = ("messages",)


def parse_chat_request(
    data: JSON,
    allow_priority: bool = False,
    limits: RequestLimits = DEFAULT_LIMITS,
    defaults: Mapping[str, float] | None = None,
) -> ChatRequest:
    f = Fields(data, CHAT, limits=limits)
    if "messages" not in data:
        raise bad("messages is required.", "messages")
    messages = parse_messages(data["messages"], limits)
    max_tokens = f.int("max_completion_tokens")
    if max_tokens is None:
        max_tokens = f.int("max_tokens")
    else:
        f.int("max_tokens")  # still type-checked
    want_logprobs = f.bool("logprobs", False)
    top_logprobs = f.int("top_logprobs")
    if top_logprobs and not want_logprobs:
        raise bad("top_logprobs requires logprobs to be true.", "top_logprobs")
    try:
        tools = parse_tools(f.data.get("tools"), f.data.get("tool_choice"), f.bool("parallel_tool_calls"))
    except ToolError as e:
        raise bad(e.message, e.param) from None
    if f.bool("store", False):
        raise not_supported("store", "Storing completions (store=true)")
    shaped(f, "metadata", METADATA, SchemaContext(limits))  # tags for stored completions: nothing is stored
    effort = f.str("reasoning_effort")
    tier = f.str("service_tier")
    if tier is not None and tier not in (CHAT["service_tier"].enum or ()):
        raise not_supported("service_tier")
    kwargs = template_kwargs(f)
    if effort is not None:
        kwargs["reasoning_effort"] = effort  # for templates that read it (vLLM passes it the same way)
    for name in ("add_generation_prompt", "continue_final_message"):
        value = f.bool(name)
        if value is not None:
            kwargs[name] = value
    if kwargs.get("continue_final_message") and kwargs.get("add_generation_prompt", True):
        if "add_generation_prompt" in kwargs:
            raise bad(
                "continue_final_message and add_generation_prompt cannot both be true.",
                "continue_final_message",
            )
        kwargs["add_generation_prompt"] = False
    if kwargs.get("continue_final_message") and messages[-1]["role"] != "assistant":
        raise bad("continue_final_message needs the last message to be from the assistant.", "messages")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    req = generation_request(
        ChatRequest,
        f,
        max_tokens,
        logprobs,
        allow_priority,
        limits,
        defaults or {},
        messages=messages,
        chat_template_kwargs=kwargs,
        tools=tools,
    )
    if tools is not None:
        kwargs["tools"] = tools.tools  # the template describes them to the model (vLLM passes them too)
        forced = tools.structured_outputs()
        if forced is not None:
            if req.params.structured_outputs is not None:
                raise bad(
                    "tool_choice 'required' or a named function cannot be combined with response_format "
                    "or structured_outputs.",
                    "tool_choice",
                )
            req.params.structured_outputs = StructuredOutputsParams(**forced)
    return req
