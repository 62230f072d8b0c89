"""POST /v1/chat/completions: admission, one engine request, then OpenAI's chat.completion JSON or its SSE
stream of chat.completion.chunk events (tool calls parsed out of the text when the request has tools)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.context import CONFIG, ENGINE, json_response
from aioengine.http.logprobs import chat_logprobs, prompt_logprobs_json
from aioengine.http.protocol import ChatRequest, parse_chat_request
from aioengine.http.reasoning import ReasoningParser
from aioengine.http.reasoning import split as split_reasoning
from aioengine.http.streaming import JSON, Tally, stream_choices
from aioengine.http.tools import StreamParser, extract
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
        text, thought = c.text, None
        if reasoning_parser is not None:
            thought, text = split_reasoning(reasoning_parser, c.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thought is not None:
            message["reasoning_content"] = thought
        finish_reason = c.finish_reason
        if req.tools is not None and req.tools.choice != "none":
            message["content"], calls, finish_reason = extract(req.tools, text, c.finish_reason)
            if calls:
                message["tool_calls"] = calls
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
    tools = req.tools if req.tools is not None and req.tools.choice != "none" else None
    parsers: dict[int, StreamParser] = {}
    thinkers: dict[int, ReasoningParser] = {}

    def choice(_i: int, c: CompletionOutput, _out: RequestOutput) -> JSON | None:
        text, thought = c.text, ""
        if reasoning_parser is not None:  # <think> text goes out as reasoning_content, apart
            thinker = thinkers.setdefault(c.index, ReasoningParser(reasoning_parser))
            thought, text = thinker.feed(c.text, final=c.finish_reason is not None)
        delta: JSON = {"content": text} if text else {}
        finish_reason = c.finish_reason
        if tools is not None:  # the text may be (part of) a tool call: the parser decides what goes out
            parser = parsers.setdefault(c.index, StreamParser(tools))
            delta = parser.delta(text) or {}
            if c.finish_reason:
                last, finish_reason = parser.finish(c.finish_reason)
                for key, value in (last or {}).items():
                    delta[key] = delta.get(key, "") + value if key == "content" else value
            elif not delta and not thought and (k is None or not c.token_ids):
                return None
        if thought:
            delta = {"reasoning_content": thought, **delta}
        elif not delta and not finish_reason and (k is None or not c.token_ids):
            return None  # the reasoning parser holds a piece that may be a tag
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
