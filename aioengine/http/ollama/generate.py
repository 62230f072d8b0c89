"""POST /api/generate and /api/chat: Ollama's generation routes over the chat and completion paths.

A body becomes a /v1/chat/completions body (generate: its system and prompt as two turns; with ``raw`` a
/v1/completions body of the prompt as it is), Ollama's ``options`` mapped to the sampling fields; it is
admitted and run as those routes run one. The reply is one object, or with ``stream`` (Ollama's default)
NDJSON lines of deltas and a last line with ``done: true``, the done_reason, the token counts and the
durations in nanoseconds. Errors are Ollama's ``{"error": message}`` (``ollama_error``).
"""

from __future__ import annotations

import json
import time
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from aioengine.engine.client import RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.chat_output import ChatOutputParser, Content, Reasoning, parse_whole
from aioengine.http.context import CONFIG, ENGINE, LOAD_SECONDS, json_response, model_names, untagged
from aioengine.http.errors import APIError, bad
from aioengine.http.openai.chat import parse_chat_request
from aioengine.http.openai.completions import parse_completion_request
from aioengine.http.parsing import ChatRequest, CompletionRequest
from aioengine.http.streaming import JSON, NDJSON_HEADERS, NDJSONWriter, Tally, guarded_stream, merged
from aioengine.http.tools import call_arguments
from aioengine.outputs import RequestOutput

# Ollama's options -> the OpenAI body's fields (vLLM's extras for the penalties and min_p)
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
}
# Options that tune Ollama's runner (threads, GPU layers, context, mirostat...): accepted, no effect here.
_RUNNER_OPTIONS = frozenset(
    {
        "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_keep", "use_mmap", "use_mlock",
        "numa", "low_vram", "f16_kv", "vocab_only", "repeat_last_n", "typical_p", "tfs_z", "mirostat",
        "mirostat_tau", "mirostat_eta", "penalize_newline",
    }
)  # fmt: skip
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "abort": "stop"}


def ollama_error(err: APIError) -> web.Response:
    """Ollama's error body: ``{"error": message}`` with the status."""
    return json_response({"error": err.message}, err.status, err.headers)


def served_model(app: web.Application, name: Any) -> str:
    """The served name an Ollama ``model`` names: itself, or without Ollama's default tag ``:latest``."""
    if not isinstance(name, str) or not name:
        raise bad("model is required", "model")
    found = untagged(model_names(app), name)
    if found is None:
        raise APIError(404, f"model '{name}' not found", "model", "model_not_found")
    return found


def _object(data: Any) -> JSON:
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    for key, why in (("images", "images"), ("suffix", "suffix (fill-in-the-middle)"), ("context", "context")):
        if data.get(key):
            more = (
                " (Ollama has deprecated it); send the conversation to /api/chat" if key == "context" else ""
            )
            raise bad(f"{why} is not supported{more}", key)
    return data


def _common(data: JSON, model: str) -> JSON:
    """The OpenAI body's fields Ollama's generate and chat share: model, stream, options, format."""
    body: JSON = {"model": model, "stream": data.get("stream", True)}
    options = data.get("options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise bad("options must be an object", "options")
    for key, value in options.items():
        if key == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad("options.num_predict must be an integer", "options.num_predict")
            if value >= 0:  # -1: until the model stops, -2: until the context is full
                body["max_tokens"] = value
        elif key in _OPTIONS:
            body[_OPTIONS[key]] = value
        elif key not in _RUNNER_OPTIONS:
            raise bad(f"unknown option {key!r}", f"options.{key}")
    fmt = data.get("format")
    if fmt == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad('format must be "json" or a JSON schema', "format")
    keep_alive = data.get("keep_alive")
    if keep_alive is not None and not isinstance(keep_alive, str | int | float):
        raise bad("keep_alive must be a duration string or a number of seconds", "keep_alive")
    return body


def _chat_body(data: JSON, model: str) -> JSON:
    body = _common(data, model)
    messages = data.get("messages") or []
    if not isinstance(messages, list):
        raise bad("messages must be a list", "messages")
    turns = []
    call_ids: dict[str, str] = {}  # a tool's name -> its last call's id: a tool turn answers that call
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        if m.get("images"):
            raise bad("images are not supported", f"messages[{i}].images")
        turn: JSON = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        well_formed = isinstance(calls, list) and all(
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and isinstance(c["function"].get("name", ""), str)
            for c in calls
        )
        if calls is not None and not well_formed:
            raise bad(
                "tool_calls must be a list of {function: {name, arguments}}", f"messages[{i}].tool_calls"
            )
        if not isinstance(m.get("tool_name", ""), str):
            raise bad("tool_name must be a string", f"messages[{i}].tool_name")
        if calls:  # Ollama's calls carry their arguments as an object; chat's as a JSON string
            turn["tool_calls"] = [
                {
                    "id": f"call_{i}_{j}",
                    "type": "function",
                    "function": {
                        "name": c["function"].get("name", ""),
                        "arguments": json.dumps(c["function"].get("arguments") or {}),
                    },
                }
                for j, c in enumerate(calls)
            ]
            call_ids |= {c["function"]["name"]: c["id"] for c in turn["tool_calls"]}
        if m["role"] == "tool":  # Ollama names the tool (or nothing); chat names the call it answers
            name = m.get("tool_name") or ""
            turn["tool_call_id"] = call_ids.get(name) or next(reversed(call_ids.values()), f"call_{i}")
            if name:
                turn["name"] = name
        turns.append(turn)
    body["messages"] = turns
    if data.get("tools"):
        body["tools"] = data["tools"]
    return body


def _generate_body(data: JSON, model: str) -> JSON:
    body = _common(data, model)
    prompt = data.get("prompt") or ""
    if not isinstance(prompt, str):
        raise bad("prompt must be a string", "prompt")
    if data.get("raw"):
        body["prompt"] = prompt
        return body
    system = data.get("system")
    body["messages"] = [
        *([{"role": "system", "content": system}] if system else []),
        {"role": "user", "content": prompt},
    ]
    return body


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def empty_reply(model: str, chat: bool, reason: str = "load") -> JSON:
    """What Ollama answers a request with no prompt: the model is loaded (``load``), or with keep_alive 0
    unloaded (``unload``: several models, http/model_pool.py)."""
    reply: JSON = {"model": model, "created_at": _now(), "done": True, "done_reason": reason}
    if chat:
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    return reply


def _stats(metrics: dict, tally: Tally, started: float, load_s: float) -> JSON:
    """The last line's counts and durations (nanoseconds; the queue's wait counts as prompt time), from the
    engine's monotonic times (arrival, first token; the end is now), and the model's load when this request
    waited for one (the total counts it, as Ollama's does)."""
    ns = 1_000_000_000
    now = time.monotonic()
    first = metrics.get("first_token_time")
    arrival = metrics.get("arrival_time") or started
    return {
        "total_duration": int((now - started + load_s) * ns),
        "load_duration": int(load_s * ns),
        "prompt_eval_count": sum(tally.prompt_tokens),
        "prompt_eval_duration": max(int((first - arrival) * ns), 0) if first is not None else 0,
        "eval_count": tally.completion_tokens,
        "eval_duration": max(int((now - first) * ns), 0) if first is not None else 0,
    }


def _calls(parsed_calls: list[dict]) -> list[JSON]:
    """Chat's calls in Ollama's shape: the arguments an object."""
    return [
        {"function": {"name": c["function"]["name"], "arguments": call_arguments(c)}} for c in parsed_calls
    ]


async def generate(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=False)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=True)


async def _run(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    admission.check_capacity(app)
    data = _object(await admission.read_json(request))
    model = served_model(app, data.get("model"))
    started = time.monotonic()
    empty = not data.get("messages") if chat else not data.get("prompt")
    if empty:
        return json_response(empty_reply(model, chat))
    body = _chat_body(data, model) if chat else _generate_body(data, model)
    given = request.headers.get("X-Request-Id")
    reasoning = app[CONFIG].reasoning_parser
    handle: RequestHandle
    if "prompt" in body:  # raw generate: the prompt as it is
        adm_c: Admitted[CompletionRequest] = await admission.admit_body(
            app, body, parse_completion_request, given, "ollama"
        )
        handle = (await admission.start_completions(app, adm_c, "ollama generate, raw"))[0]
        tools, rid, stream, reasoning = None, adm_c.request_id, adm_c.req.stream, None
    else:
        adm: Admitted[ChatRequest] = await admission.admit_body(
            app, body, parse_chat_request, given, "ollama"
        )
        handle = admission.start_chat(app, adm, f"ollama {'chat' if chat else 'generate'}")
        tools, rid, stream = adm.req.tools, adm.request_id, adm.req.stream
    if stream:
        return await _stream(request, handle, rid, model, chat, tools, reasoning, started)
    out = await handle
    c = out.outputs[0]
    parsed = parse_whole(reasoning, tools, c.text, c.finish_reason)
    reply: JSON = {"model": model, "created_at": _now()}
    if chat:
        message: JSON = {"role": "assistant", "content": parsed.content or ""}
        if parsed.reasoning is not None:
            message["thinking"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = _calls(parsed.tool_calls)
        reply["message"] = message
    else:
        reply["response"] = parsed.content or ""
        if parsed.reasoning is not None:
            reply["thinking"] = parsed.reasoning
    reply |= {"done": True, "done_reason": _DONE_REASONS.get(c.finish_reason or "stop", "stop")}
    reply |= _stats(out.metrics, Tally.of([out]), started, request.get(LOAD_SECONDS) or 0.0)
    return json_response(reply, headers={"X-Request-Id": rid})


async def _stream(
    request: web.Request,
    handle: RequestHandle,
    rid: str,
    model: str,
    chat: bool,
    tools: Any,
    reasoning: str | None,
    started: float,
) -> web.StreamResponse:
    parser = ChatOutputParser(reasoning, tools)

    def line(text: str = "", thinking: str = "") -> JSON:
        obj: JSON = {"model": model, "created_at": _now()}
        if chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:
                obj["message"]["thinking"] = thinking
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = False
        return obj

    async def write(nd: NDJSONWriter) -> None:
        last: RequestOutput | None = None
        tally = Tally([0], [0])
        async with aclosing(merged([handle])) as deltas:
            async for i, out in deltas:
                last = out
                tally.add(i, out)
                c = out.outputs[0]
                events = parser.feed(c.text)
                if c.finish_reason:
                    events += parser.finish(c.finish_reason)
                text = "".join(e.text for e in events if isinstance(e, Content))
                thought = "".join(e.text for e in events if isinstance(e, Reasoning))
                if text or thought:
                    await nd.send(line(text, thought))
        end = line()
        if chat and parser.tool_calls:  # Ollama sends a call whole, not its argument deltas
            end["message"]["tool_calls"] = _calls(parser.tool_calls)
        finish = last.outputs[0].finish_reason if last is not None else None
        end |= {"done": True, "done_reason": _DONE_REASONS.get(finish or "stop", "stop")}
        load_s = request.get(LOAD_SECONDS) or 0.0
        await nd.done(end | _stats(last.metrics if last is not None else {}, tally, started, load_s))

    async def write_error(nd: NDJSONWriter, err: APIError) -> None:
        await nd.done({"error": err.message})

    engine = request.app[ENGINE]
    return await guarded_stream(
        request, engine, [handle], rid, write, write_error, NDJSON_HEADERS, NDJSONWriter
    )
