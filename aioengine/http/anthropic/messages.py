"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages body becomes a chat request (system prompt, turns, text / tool_use / tool_result blocks, tools
and tool_choice, stop_sequences, sampling), admitted and run as /v1/chat/completions runs one; its output
becomes a `message` object, or Anthropic's event stream: message_start, ping, per block
content_block_start / content_block_delta / content_block_stop, message_delta (stop_reason and usage),
message_stop. Errors on these routes have Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.chat_output import ChatOutputParser, Content, Reasoning, ToolCall, parse_whole
from aioengine.http.context import CONFIG, ENGINE, check_model, json_response
from aioengine.http.errors import APIError, bad
from aioengine.http.openai.chat import parse_chat_request
from aioengine.http.parsing import ChatRequest
from aioengine.http.schema import SchemaContext
from aioengine.http.shapes import Array, Either, Obj, Shape, Tagged, Unsupported, Value
from aioengine.http.streaming import JSON, SSEWriter, Tally, guarded_sse, merged
from aioengine.http.tools import call_arguments
from aioengine.outputs import CompletionOutput

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "timeout": "pause_turn",
}
# vLLM's sampling extras, taken here as on the chat route (a client sends them with extra_body).
_VLLM_EXTRAS = (
    "seed",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "structured_outputs",
    "chat_template_kwargs",
    "timeout_s",
    "thinking_token_budget",
)
# ---- the request's shape: declared once, checked before it is read, and stated in /openapi.json ------------
_STR = Value(str)
_TEXT = Obj({"type": _STR, "text": _STR}, ("text",), open=True)
_TEXT_BLOCKS = Array(Tagged("type", {"text": _TEXT}, unsupported="Blocks of type {} here"), what="blocks")
_BLOCK = Tagged(
    "type",
    {
        "text": _TEXT,
        "tool_use": Obj(
            {"type": _STR, "id": _STR, "name": _STR, "input": Value(dict)}, ("id", "name"), open=True
        ),
        "tool_result": Obj(
            {
                "type": _STR,
                "tool_use_id": _STR,
                "content": Either((_STR, _TEXT_BLOCKS), "a string or an array of text blocks"),
                "is_error": Value(bool),
            },
            ("tool_use_id",),
            open=True,
        ),
        "thinking": Obj({"type": _STR}, open=True),  # earlier reasoning: dropped, as the templates do
        "redacted_thinking": Obj({"type": _STR}, open=True),
    },
    unsupported="Content blocks of type {}",
)
_CONTENT = Either((_STR, Array(_BLOCK, what="content blocks")), "a string or an array of content blocks")
_TURN = Obj({"role": _STR, "content": _CONTENT}, ("content",), open=True)
_PARALLEL = Value(bool)
_TOOL_CHOICE = Tagged(
    "type",
    {
        "auto": Obj({"type": _STR, "disable_parallel_tool_use": _PARALLEL}),
        "any": Obj({"type": _STR, "disable_parallel_tool_use": _PARALLEL}),
        "tool": Obj({"type": _STR, "name": _STR, "disable_parallel_tool_use": _PARALLEL}, ("name",)),
        "none": Obj({"type": _STR}),
    },
)
_TOOL = Tagged(
    "type",
    {
        "custom": Obj(
            {"type": _STR, "name": _STR, "description": _STR, "input_schema": Value(dict)},
            ("name", "input_schema"),
            open=True,
        )
    },
    unsupported="Server tools ({})",
    default="custom",
)
_THINKING = Tagged(
    "type",
    {
        "enabled": Obj({"type": _STR, "budget_tokens": Value(int)}, ("budget_tokens",), open=True),
        "disabled": Obj({"type": _STR}, open=True),
    },
)
# The body. vLLM's sampling extras pass through to the chat parser, which checks them (and any other key).
_FIELDS: dict[str, Shape] = {
    "model": _STR,
    "max_tokens": Value(int, description="at least 1; prompt + max_tokens must fit max_model_len"),
    "messages": Array(
        Tagged("role", {"user": _TURN, "assistant": _TURN}), 1, lambda limits: limits.max_messages, "messages"
    ),
    "system": Either((_STR, _TEXT_BLOCKS), "a string or an array of text blocks"),
    "tools": Array(_TOOL, what="tools"),
    "tool_choice": _TOOL_CHOICE,
    "stop_sequences": Array(_STR, what="stop sequences"),
    "temperature": Value(float),
    "top_p": Value(float),
    "top_k": Value(int),
    "stream": Value(bool),
    "thinking": _THINKING,
    "metadata": Obj({"user_id": _STR}, open=True),
    "container": Unsupported("Containers"),
    "mcp_servers": Unsupported("MCP servers"),
    "service_tier": Unsupported("service_tier"),
}
MESSAGES_REQUEST = Obj(_FIELDS, ("max_tokens", "messages"), open=True)
COUNT_TOKENS_REQUEST = Obj(_FIELDS, ("messages",), open=True)


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(err: APIError) -> web.Response:
    """An APIError in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    return web.json_response(
        body, status=err.status, headers=err.headers, dumps=lambda o: orjson.dumps(o).decode()
    )


# ---- the request, checked, as a chat body ------------------------------------------------------------------
def _blocks(content: str | list[dict]) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _joined_text(content: str | list[dict] | None) -> str:
    return "\n".join(b["text"] for b in _blocks(content or []))


def _messages(data: JSON) -> list[dict]:
    """Anthropic's system and messages as chat messages (tool_use -> tool_calls, tool_result -> tool)."""
    out: list[dict] = []
    if data.get("system") is not None:
        out.append({"role": "system", "content": _joined_text(data["system"])})
    for i, m in enumerate(data["messages"]):
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(_blocks(m["content"])):
            kind, at = block["type"], f"messages[{i}].content[{j}]"
            if kind == "text":
                texts.append(block["text"])
            elif kind == "tool_use" and m["role"] == "assistant":
                args = json.dumps(block.get("input") or {})
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": args},
                    }
                )
            elif kind == "tool_result" and m["role"] == "user":
                text = _joined_text(block.get("content"))
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {text}" if block.get("is_error") else text,
                    }
                )
            elif kind in ("tool_use", "tool_result"):
                turn = "assistant" if kind == "tool_use" else "user"
                raise bad(f"{at}: {kind} blocks belong to {turn} turns.", at)
        if texts or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(data: JSON) -> tuple[list[dict] | None, Any, bool | None]:
    """Anthropic's tools and tool_choice as chat's (tools, tool_choice, parallel_tool_calls)."""
    chat_tools = None
    if data.get("tools") is not None:
        chat_tools = []
        for t in data["tools"]:
            fn: dict[str, Any] = {"name": t["name"], "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat_tools.append({"type": "function", "function": fn})
    choice = data.get("tool_choice")
    if choice is None:
        return chat_tools, None, None
    no_parallel = choice.get("disable_parallel_tool_use")
    parallel = None if no_parallel is None else not no_parallel
    if choice["type"] == "tool":
        return chat_tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    return chat_tools, {"auto": "auto", "any": "required", "none": "none"}[choice["type"]], parallel


def to_chat_body(data: Any, shape: Obj = MESSAGES_REQUEST) -> JSON:
    """A Messages body, checked against its shape, as a /v1/chat/completions body (which the chat parser
    checks again: sampling values, limits, the extras)."""
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    shape.check(data, "", SchemaContext())
    body: JSON = {"messages": _messages(data)}
    for key in ("max_tokens", "model", "temperature", "top_p", "top_k", "stream", *_VLLM_EXTRAS):
        if key in data:
            body[key] = data[key]
    if data.get("stop_sequences") is not None:
        body["stop"] = data["stop_sequences"]
    thinking = data.get("thinking")
    if thinking is not None and thinking["type"] == "enabled":
        # extended thinking: its budget caps the think block (a server's parser finds it)
        budget = thinking["budget_tokens"]
        if budget < 1:
            raise bad("thinking.budget_tokens: a positive integer is required.", "thinking.budget_tokens")
        if type(data.get("max_tokens")) is int and budget >= data["max_tokens"]:
            raise bad("thinking.budget_tokens must be less than max_tokens.", "thinking.budget_tokens")
        body["thinking_token_budget"] = budget
    metadata = data.get("metadata")
    if metadata is not None and metadata.get("user_id") is not None:
        body["user"] = metadata["user_id"]
    tools, choice, parallel = _tools(data)
    if tools is not None:
        body["tools"] = tools
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


# ---- the routes -----------------------------------------------------------------------------------------
async def messages(request: web.Request) -> web.StreamResponse:
    _, adm = await admission.admit_translated(request, to_chat_body, parse_chat_request, "msg")
    handle = admission.start_chat(request.app, adm, f"messages, {len(adm.req.messages)} messages")
    engine = request.app[ENGINE]
    reasoning = request.app[CONFIG].reasoning_parser
    if adm.req.stream:
        return await stream_message(request, engine, adm, handle, reasoning)
    out = await handle
    return json_response(
        message(adm, out.outputs[0], Tally.of([out]), reasoning), headers={"X-Request-Id": adm.request_id}
    )


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's token count as /v1/messages would template it: ``{"input_tokens": N}``."""
    data = await admission.read_json(request)
    body = to_chat_body(data, COUNT_TOKENS_REQUEST)
    body["max_tokens"] = 1
    body.pop("stream", None)
    engine = request.app[ENGINE]
    req = parse_chat_request(
        body, engine.allow_priority, request.app[CONFIG].limits, engine.default_sampling_params
    )
    check_model(request.app, req.model)
    ids = engine.render_chat(req.messages, req.chat_template_kwargs)
    return json_response({"input_tokens": len(ids)})


def _message_id(request_id: str) -> str:
    return request_id if request_id.startswith("msg") else f"msg_{uuid.uuid4().hex}"


def _blocks_of(
    adm: Admitted[ChatRequest], c: CompletionOutput, reasoning_parser: str | None
) -> tuple[list[JSON], str | None, bool]:
    """A finished completion's content blocks (thinking first, when a parser found any), its chat
    finish_reason, and whether it called a tool."""
    parsed = parse_whole(reasoning_parser, adm.req.tools, c.text, c.finish_reason)
    blocks: list[JSON] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    text = parsed.content or ""
    if text or not parsed.tool_calls:
        blocks.append({"type": "text", "text": text})
    for call in parsed.tool_calls:
        blocks.append(_tool_use(call))
    return blocks, parsed.finish_reason, parsed.called


def _tool_use(call: dict) -> JSON:
    return {
        "type": "tool_use",
        "id": _tool_id(call["id"]),
        "name": call["function"]["name"],
        "input": call_arguments(call),
    }


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("chatcmpl-tool-")


def _stop(c: CompletionOutput, finish: str | None, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence). A reply that holds a tool call stops for "tool_use", as Anthropic's API
    says whatever forced the call (tool_choice auto, any or a named tool), unless it was cut short."""
    if called and finish != "length":
        return "tool_use", None
    if finish == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return _STOP_REASONS.get(finish or "stop", "end_turn"), None


def _usage(tally: Tally) -> JSON:
    cached = sum(tally.cached_tokens)
    return {
        "input_tokens": sum(tally.prompt_tokens) - cached,
        "output_tokens": tally.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def message(
    adm: Admitted[ChatRequest], c: CompletionOutput, tally: Tally, reasoning_parser: str | None = None
) -> JSON:
    blocks, finish, called = _blocks_of(adm, c, reasoning_parser)
    stop_reason, stop_sequence = _stop(c, finish, called)
    return {
        "id": _message_id(adm.request_id),
        "type": "message",
        "role": "assistant",
        "model": adm.model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(tally),
    }


async def stream_message(
    request: web.Request,
    engine: EngineClient,
    adm: Admitted[ChatRequest],
    handle: RequestHandle,
    reasoning_parser: str | None = None,
) -> web.StreamResponse:
    tally = Tally([0], [0])
    parser = ChatOutputParser(reasoning_parser, adm.req.tools)
    start: JSON = {
        "id": _message_id(adm.request_id),
        "type": "message",
        "role": "assistant",
        "model": adm.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }

    async def write(sse: SSEWriter) -> None:
        blocks = _BlockStream(sse)
        first = True
        last = None
        async with aclosing(merged([handle])) as deltas:
            async for i, out in deltas:
                tally.add(i, out)
                if first:  # the prompt's size is known once the engine has the request
                    await sse.send_event(
                        {"type": "message_start", "message": {**start, "usage": _usage(tally)}}
                    )
                    await sse.send_event({"type": "ping"})
                    first = False
                c = last = out.outputs[0]
                events = parser.feed(c.text)
                if c.finish_reason:
                    events += parser.finish(c.finish_reason)
                for e in events:  # <think> text streams as a thinking block, first
                    if isinstance(e, Reasoning):
                        await blocks.thinking(e.text)
                    elif isinstance(e, Content):
                        await blocks.text(e.text)
                    else:
                        await blocks.tool_call(e)
        await blocks.close()
        assert last is not None
        stop_reason, stop_sequence = _stop(last, parser.finish_reason, parser.called)
        await sse.done_named(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": tally.completion_tokens},
            },
            {"type": "message_stop"},
        )

    async def write_error(sse: SSEWriter, err: APIError) -> None:
        kind = _ERROR_TYPES.get(err.status, "api_error")
        await sse.done_named({"type": "error", "error": {"type": kind, "message": err.message}})

    return await guarded_sse(request, engine, [handle], adm.request_id, write, write_error)


class _BlockStream:
    """Content blocks as Anthropic streams them: each one opened, given deltas, closed before the next."""

    def __init__(self, sse: SSEWriter) -> None:
        self.sse = sse
        self.index = -1
        self.open: str | None = None  # "text", or the streamed call's index (a named tool_choice)

    async def _start(self, block: JSON, key: str) -> None:
        await self.close()
        self.index += 1
        self.open = key
        await self.sse.send_event(
            {"type": "content_block_start", "index": self.index, "content_block": block}
        )

    async def close(self) -> None:
        if self.open is not None:
            await self.sse.send_event({"type": "content_block_stop", "index": self.index})
            self.open = None

    async def thinking(self, text: str) -> None:
        if not text:
            return
        if self.open != "thinking":
            await self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
        delta = {"type": "thinking_delta", "thinking": text}
        await self.sse.send_event({"type": "content_block_delta", "index": self.index, "delta": delta})

    async def text(self, text: str) -> None:
        if not text:
            return
        if self.open != "text":
            await self._start({"type": "text", "text": ""}, "text")
        await self.sse.send_event(
            {
                "type": "content_block_delta",
                "index": self.index,
                "delta": {"type": "text_delta", "text": text},
            }
        )

    async def tool_call(self, call: ToolCall) -> None:
        """A tool-call event: one with an id opens a tool_use block; its arguments stream as JSON."""
        if call.id is not None:
            block: JSON = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
            await self._start(block, f"call-{call.index}")
        args = call.arguments
        if args:
            delta = {"type": "input_json_delta", "partial_json": args}
            await self.sse.send_event({"type": "content_block_delta", "index": self.index, "delta": delta})
