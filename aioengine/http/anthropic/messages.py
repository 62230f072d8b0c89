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
from aioengine.http.errors import APIError, bad, not_supported
from aioengine.http.parsing import ChatRequest, parse_chat_request
from aioengine.http.streaming import JSON, SSEWriter, Tally, guarded_sse, merged
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
# Fields of a Messages body that have no chat equivalent here.
_REFUSED = {
    "container": "Containers",
    "mcp_servers": "MCP servers",
    "service_tier": None,
}


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(err: APIError) -> web.Response:
    """An APIError in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": err.message}}
    return web.json_response(
        body, status=err.status, headers=err.headers, dumps=lambda o: orjson.dumps(o).decode()
    )


# ---- the request ----------------------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or an array of content blocks.", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad(f"{where}.{i} must be a content block object with a type.", where)
    return content


def _text_of(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text must be a string.", where)
    return text


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise not_supported(f"{where}.{i}", f"tool_result content of type {block['type']!r}")
        parts.append(_text_of(block, f"{where}.{i}"))
    return "\n".join(parts)


def _messages(data: JSON) -> list[dict]:
    """Anthropic's system and messages as chat messages (tool_use -> tool_calls, tool_result -> tool)."""
    out: list[dict] = []
    system = data.get("system")
    if system is not None:
        if isinstance(system, str):
            text = system
        else:
            blocks = _blocks(system, "system")
            if any(b["type"] != "text" for b in blocks):
                raise bad("system blocks must be of type text.", "system")
            text = "\n".join(_text_of(b, "system") for b in blocks)
        out.append({"role": "system", "content": text})
    raw = data.get("messages")
    if raw is None:
        raise bad("messages: Field required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty array.", "messages")
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant'.", "messages")
        if "content" not in m:
            raise bad(f"{where}.content: Field required", "messages")
        texts: list[str] = []
        calls: list[dict] = []
        for j, block in enumerate(_blocks(m["content"], f"{where}.content")):
            kind, at = block["type"], f"{where}.content.{j}"
            if kind == "text":
                texts.append(_text_of(block, at))
            elif kind == "tool_use" and m["role"] == "assistant":
                name, tool_id = block.get("name"), block.get("id")
                if not isinstance(name, str) or not isinstance(tool_id, str):
                    raise bad(f"{at}: tool_use needs a string id and name.", "messages")
                args = block.get("input", {})
                if not isinstance(args, dict):
                    raise bad(f"{at}.input must be an object.", "messages")
                calls.append(
                    {
                        "id": tool_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                )
            elif kind == "tool_result" and m["role"] == "user":
                tool_id = block.get("tool_use_id")
                if not isinstance(tool_id, str):
                    raise bad(f"{at}.tool_use_id must be a string.", "messages")
                text = _tool_result_text(block.get("content"), f"{at}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier reasoning: the templates drop it from past turns too
            elif kind in ("tool_use", "tool_result"):
                raise bad(
                    f"{at}: {kind} blocks belong to {'assistant' if kind == 'tool_use' else 'user'} turns.",
                    "messages",
                )
            else:
                raise not_supported(at, f"Content blocks of type {kind!r}")
        if texts or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(data: JSON) -> tuple[list[dict] | None, Any, bool | None]:
    """Anthropic's tools and tool_choice as chat's (tools, tool_choice, parallel_tool_calls)."""
    tools = data.get("tools")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be an array.", "tools")
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise bad(f"tools.{i} must be an object with a string name.", "tools")
            if t.get("type") not in (None, "custom"):
                raise not_supported(f"tools.{i}", f"Server tools ({t['type']!r})")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise bad(f"tools.{i}.input_schema: Field required (a JSON schema object)", "tools")
            fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat_tools.append({"type": "function", "function": fn})
    choice = data.get("tool_choice")
    if choice is None:
        return chat_tools, None, None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be an object of type auto, any, tool or none.", "tool_choice")
    parallel = (
        None if choice.get("disable_parallel_tool_use") is None else not choice["disable_parallel_tool_use"]
    )
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad("tool_choice of type tool needs the tool's name.", "tool_choice")
        return chat_tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    return chat_tools, {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def to_chat_body(data: JSON) -> JSON:
    """A Messages body as a /v1/chat/completions body (checked again by the chat parser)."""
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    for key, what in _REFUSED.items():
        if key in data:
            raise not_supported(key, what)
    if "max_tokens" not in data:
        raise bad("max_tokens: Field required", "max_tokens")
    body: JSON = {"messages": _messages(data), "max_tokens": data["max_tokens"]}
    for key in ("model", "temperature", "top_p", "top_k", "stream", *_VLLM_EXTRAS):
        if key in data:
            body[key] = data[key]
    stops = data.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise bad("stop_sequences must be an array of strings.", "stop_sequences")
        body["stop"] = stops
    thinking = data.get("thinking")
    if (
        thinking is not None
    ):  # extended thinking: its budget caps the think block (a server's parser finds it)
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise bad("thinking must be an object of type enabled or disabled.", "thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if type(budget) is not int or budget < 1:
                raise bad("thinking.budget_tokens: a positive integer is required.", "thinking.budget_tokens")
            if type(data["max_tokens"]) is int and budget >= data["max_tokens"]:
                raise bad("thinking.budget_tokens must be less than max_tokens.", "thinking.budget_tokens")
            body["thinking_token_budget"] = budget
    metadata = data.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad("metadata must be an object.", "metadata")
        if metadata.get("user_id") is not None:
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
    _, adm = await admission.admit_translated(request, to_chat_body, "msg")
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
    body = to_chat_body({**data, "max_tokens": 1} if isinstance(data, dict) else data)
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
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": _tool_id(call["id"]), "name": call["function"]["name"], "input": args}


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
