"""POST /v1/chat/completions: admission, one engine request, then OpenAI's chat.completion JSON or its SSE
stream of chat.completion.chunk events (tool calls parsed out of the text when the request has tools)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.chat_output import ChatOutputParser, chat_delta, parse_whole
from aioengine.http.context import CONFIG, ENGINE, json_response
from aioengine.http.logprobs import chat_logprobs, prompt_logprobs_json
from aioengine.http.parsing import ChatRequest, parse_chat_request
from aioengine.http.streaming import JSON, Tally, stream_choices
from aioengine.outputs import CompletionOutput, RequestOutput


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
