"""Chat and completion generation: start engine requests, then answer with OpenAI JSON or an SSE stream."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from aioengine.engine_client import EngineClient
from aioengine.errors import AioEngineError, InvalidRequestError
from aioengine.http.logprobs import CompletionLogprobs, chat_logprobs
from aioengine.http.protocol import APIError, ChatRequest, CompletionRequest, bad, error_dict, from_invalid
from aioengine.http.tools import StreamParser, extract
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.tokenizer import apply_chat_template

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Prompts longer than this (in characters) are tokenized on a worker thread: on the loop, a 4 MiB prompt
# stalled every stream for 1.4-2.2 s; the tokenizer releases the GIL, so the loop keeps serving.
OFFLOAD_CHARS = 1 << 16


def new_request_id(given: str | None, prefix: str) -> str:
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not _REQUEST_ID_RE.match(given):
        raise bad("request_id (or the X-Request-Id header) must be 1-128 letters, digits or ._:-", "request_id")
    return given


def engine_error(e: AioEngineError) -> APIError:
    """InvalidRequestError -> 400; a dead or stopped engine -> 503."""
    if isinstance(e, InvalidRequestError):
        return from_invalid(e)
    return APIError(503, f"The engine is not serving: {e}", code="engine_dead")


async def prepare(engine: EngineClient, req: ChatRequest | CompletionRequest) -> None:
    """The slow parts of starting a request, off the event loop: tokenize (chat: template) prompts over
    OFFLOAD_CHARS characters into `prompt_ids`, and compile a grammar (a 0.36 MB JSON schema took 2.6 s on
    the loop; xgrammar releases the GIL, so the loop keeps serving while it compiles on a thread)."""
    try:
        if req.params.structured_outputs is not None:
            try:
                await engine.precompile(req.params)
            except InvalidRequestError as e:
                forced = isinstance(req, ChatRequest) and req.tools is not None and req.tools.structured_outputs()
                if forced:
                    raise bad(f"A tool's parameters schema cannot force the call: {e.message}", "tools") from None
                raise
        if isinstance(req, ChatRequest):
            size = sum(len(m["content"]) for m in req.messages)
            if req.tools is not None:  # the template renders them too (Qwen's writes each as JSON)
                size += len(orjson.dumps(req.tools.tools))
            if size > OFFLOAD_CHARS:
                req.prompt_ids = await asyncio.to_thread(apply_chat_template, engine.tokenizer, req.messages,
                                                         **req.chat_template_kwargs)
            return
        for i, p in enumerate(req.prompts):
            if isinstance(p, str) and len(p) > OFFLOAD_CHARS:
                req.prompt_ids[i] = list(await asyncio.to_thread(engine.tokenizer.encode, p))
    except AioEngineError as e:
        raise engine_error(e) from None


def start_chat(engine: EngineClient, req: ChatRequest, request_id: str) -> list:
    try:
        if req.prompt_ids is not None:
            return [engine.generate(req.prompt_ids, req.params, request_id=request_id, priority=req.priority)]
        return [engine.chat(req.messages, req.params, request_id=request_id, priority=req.priority,
                            chat_template_kwargs=req.chat_template_kwargs or None)]
    except AioEngineError as e:
        raise engine_error(e) from None


async def start_completions(engine: EngineClient, req: CompletionRequest, request_id: str) -> list:
    handles: list = []
    try:
        for i, prompt in enumerate(req.prompts):
            rid = request_id if len(req.prompts) == 1 else f"{request_id}-{i}"
            handles.append(engine.generate(req.prompt_ids.get(i, prompt), req.params, request_id=rid,
                                           priority=req.priority))
    except AioEngineError as e:
        for h in handles:  # one bad prompt in a batch fails the whole batch
            await engine.abort(h.request_id)
        err = engine_error(e)
        if len(req.prompts) > 1 and err.status == 400:
            err.message = f"prompt[{len(handles)}]: {err.message}"
        raise err from None
    return handles


async def merged(handles: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The deltas of several requests as they come, tagged with the request's position.

    Closing this generator (or cancelling its consumer) aborts every request still running.
    """
    if len(handles) == 1:
        async with aclosing(handles[0].__aiter__()) as it:
            async for out in it:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: Any) -> None:
        try:
            async with aclosing(h.__aiter__()) as it:
                async for out in it:
                    queue.put_nowait((i, out))
        except Exception as e:  # the engine died: hand the error to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield i, item
            if item.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()


@dataclass(slots=True)
class Tally:
    """Token counts of one HTTP request (all its prompts and completions)."""

    prompt_tokens: list[int]
    cached_tokens: list[int]
    completion_tokens: int = 0

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


class SSEWriter:
    """Writes `data: <json>` events; a vanished client raises ConnectionResetError from write()."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp

    async def send(self, obj: dict) -> None:
        await self.resp.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def send_event(self, obj: dict) -> None:
        """A named event (`event: <type>`), as the Responses API streams them."""
        await self.resp.write(b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n")

    async def done(self) -> None:
        await self.resp.write(b"data: [DONE]\n\n")
        await self.resp.write_eof()


async def open_sse(request: web.Request, request_id: str) -> SSEWriter:
    resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": request_id})
    await resp.prepare(request)
    return SSEWriter(resp)


# ---- chat ---------------------------------------------------------------------------------------------
def chat_response(engine: EngineClient, req: ChatRequest, request_id: str, model: str, outs: list[RequestOutput]) -> dict:
    out = outs[0]
    k = req.params.logprobs
    tally = Tally([len(out.prompt_token_ids)], [out.num_cached_tokens])
    tally.completion_tokens = out.num_generated_tokens
    choices = []
    for c in out.outputs:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if req.tools is not None and req.tools.choice != "none":
            message["content"], calls, finish_reason = extract(req.tools, c.text, c.finish_reason)
            if calls:
                message["tool_calls"] = calls
        choices.append({"index": c.index, "message": message,
                        "logprobs": None if k is None else chat_logprobs(engine, c.token_ids, c.logprobs, k),
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": tally.usage()}


async def stream_chat(request: web.Request, engine: EngineClient, req: ChatRequest, handles: list, request_id: str,
                      model: str) -> web.StreamResponse:
    created = int(time.time())
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    k = req.params.logprobs

    tools = req.tools if req.tools is not None and req.tools.choice != "none" else None
    parsers: dict[int, StreamParser] = {}

    def choice(_i: int, c: CompletionOutput, _out: RequestOutput) -> dict | None:
        delta, finish_reason = ({"content": c.text} if c.text else {}), c.finish_reason
        if tools is not None:  # the text may be (part of) a tool call: the parser decides what goes out
            parser = parsers.setdefault(c.index, StreamParser(tools))
            delta = parser.delta(c.text) or {}
            if c.finish_reason:
                last, finish_reason = parser.finish(c.finish_reason)
                for key, value in (last or {}).items():
                    delta[key] = delta.get(key, "") + value if key == "content" else value
            elif not delta and (k is None or not c.token_ids):
                return None
        d = {"index": c.index, "delta": delta,
             "logprobs": None if k is None else chat_logprobs(engine, c.token_ids, c.logprobs, k),
             "finish_reason": finish_reason}
        if finish_reason:
            d["stop_reason"] = c.stop_reason
        return d

    first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(req.params.n)]
    return await _stream(request, engine, req, handles, request_id, base, first, choice)


# ---- completions --------------------------------------------------------------------------------------
def prompt_text(engine: EngineClient, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)


def completion_response(engine: EngineClient, req: CompletionRequest, request_id: str, model: str,
                        outs: list[RequestOutput]) -> dict:
    n, k = req.params.n, req.params.logprobs
    tally = Tally([len(o.prompt_token_ids) for o in outs], [o.num_cached_tokens for o in outs])
    choices = []
    for i, out in enumerate(outs):
        echo = prompt_text(engine, req.prompts[i]) if req.echo else ""
        tally.completion_tokens += out.num_generated_tokens
        for c in out.outputs:
            lp = None
            if k is not None:
                renderer = CompletionLogprobs(engine, k)
                lp = _joined(renderer.render(out.prompt_token_ids, out.prompt_logprobs) if req.echo else None,
                             renderer.render(c.token_ids, c.logprobs))
            choices.append({"index": i * n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": tally.usage()}


async def stream_completions(request: web.Request, engine: EngineClient, req: CompletionRequest, handles: list,
                             request_id: str, model: str) -> web.StreamResponse:
    n, k = req.params.n, req.params.logprobs
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    renderers: dict[int, CompletionLogprobs] = {}
    prompt_logprobs: dict[int, list] = {}  # per prompt, from its first output

    def choice(i: int, c: CompletionOutput, out: RequestOutput) -> dict:
        index = i * n + c.index
        lp, text = None, c.text
        if k is not None:
            echoed = None
            if index not in renderers:
                renderers[index] = CompletionLogprobs(engine, k)
                if req.echo:  # the prompt goes out with this choice's first chunk, with its logprobs
                    text = prompt_text(engine, req.prompts[i]) + text
                    echoed = renderers[index].render(out.prompt_token_ids, prompt_logprobs.get(i))
            lp = _joined(echoed, renderers[index].render(c.token_ids, c.logprobs))
        d = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if c.finish_reason:
            d["stop_reason"] = c.stop_reason
        return d

    def on_output(i: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs

    first = []
    if req.echo and k is None:
        first = [{"index": i * n + j, "text": prompt_text(engine, p), "logprobs": None, "finish_reason": None}
                 for i, p in enumerate(req.prompts) for j in range(n)]
    return await _stream(request, engine, req, handles, request_id, base, first, choice, on_output)


def _joined(a: dict | None, b: dict) -> dict:
    return b if a is None else {key: a[key] + b[key] for key in a}


async def _stream(request: web.Request, engine: EngineClient, req: ChatRequest | CompletionRequest, handles: list,
                  request_id: str, base: dict, first: list[dict],
                  make_choice: Callable[[int, CompletionOutput, RequestOutput], dict | None],
                  on_output: Callable[[int, RequestOutput], None] | None = None) -> web.StreamResponse:
    """One SSE stream for both endpoints: one chunk per changed choice, usage last, then [DONE]."""
    tally = Tally([0] * len(handles), [0] * len(handles))

    async def write(sse: SSEWriter) -> None:
        async with aclosing(merged(handles)) as deltas:
            for c in first:
                await sse.send({**base, "choices": [c]})
            async for i, out in deltas:
                tally.add(i, out)
                if on_output is not None:
                    on_output(i, out)
                for c in out.outputs:
                    if not c.text and c.finish_reason is None and (req.params.logprobs is None or not c.token_ids):
                        continue  # the detokenizer is holding text back: nothing to say yet
                    choice = make_choice(i, c, out)
                    if choice is None:
                        continue
                    chunk = {**base, "choices": [choice]}
                    if req.continuous_usage_stats:
                        chunk["usage"] = tally.usage()
                    await sse.send(chunk)
        if req.include_usage:
            await sse.send({**base, "choices": [], "usage": tally.usage()})
        await sse.done()

    async def write_error(sse: SSEWriter, err: APIError) -> None:
        await sse.send(error_dict(err.status, err.message, code=err.code))
        await sse.done()

    return await guarded_sse(request, engine, handles, request_id, write, write_error)


async def guarded_sse(request: web.Request, engine: EngineClient, handles: list, request_id: str,
                      write: Callable[[SSEWriter], Awaitable[None]],
                      write_error: Callable[[SSEWriter, APIError], Awaitable[None]]) -> web.StreamResponse:
    """Open the stream, run ``write``; a vanished client ends it quietly, a dead engine gets ``write_error``;
    whatever is still running is aborted at the end, also when the stream never opened."""
    try:
        sse = await open_sse(request, request_id)
    except BaseException:
        await abort_all(engine, handles)
        raise
    try:
        await write(sse)
    except ConnectionResetError:
        pass  # the client left; its requests are aborted below
    except AioEngineError as e:
        with suppress(ConnectionResetError):
            await write_error(sse, engine_error(e))
    finally:
        await abort_all(engine, handles)
    return sse.resp


async def abort_all(engine: EngineClient, handles: list) -> None:
    """Abort whatever is still running (a no-op for finished requests), also when never iterated."""
    for h in handles:
        await engine.abort(h.request_id)


# ---- responses (/v1/responses) ------------------------------------------------------------------------
def response_object(builder: Any, out: RequestOutput) -> dict:
    tally = Tally([len(out.prompt_token_ids)], [out.num_cached_tokens], out.num_generated_tokens)
    c = out.outputs[0]
    return builder.response("completed", c.text, c.finish_reason, tally.usage())


async def stream_response(request: web.Request, engine: EngineClient, handles: list, request_id: str, builder: Any
                          ) -> web.StreamResponse:
    """The Responses API's events: created, the message item and its text part opening, one text delta per
    engine delta, then the closing events and `response.completed` (or `response.incomplete`) with usage."""
    tally = Tally([0], [0])

    async def write(sse: SSEWriter) -> None:
        text, finish = "", None
        await sse.send_event(builder.event("response.created", response=builder.response("in_progress")))
        await sse.send_event(builder.event("response.in_progress", response=builder.response("in_progress")))
        await sse.send_event(builder.event("response.output_item.added", output_index=0,
                                           item=builder.message(None, "in_progress")))
        await sse.send_event(builder.text_event("response.content_part.added", part=builder.part("")))
        async with aclosing(merged(handles)) as deltas:
            async for i, out in deltas:
                tally.add(i, out)
                c = out.outputs[0]
                finish = c.finish_reason or finish
                if c.text:
                    text += c.text
                    await sse.send_event(builder.text_event("response.output_text.delta", delta=c.text, logprobs=[]))
        await sse.send_event(builder.text_event("response.output_text.done", text=text, logprobs=[]))
        await sse.send_event(builder.text_event("response.content_part.done", part=builder.part(text)))
        final = builder.response("completed", text, finish, tally.usage())
        await sse.send_event(builder.event("response.output_item.done", output_index=0, item=final["output"][0]))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        await sse.send_event(builder.event(kind, response=final))
        await sse.resp.write_eof()

    async def write_error(sse: SSEWriter, err: APIError) -> None:
        await sse.send_event(builder.event("error", code=err.code, message=err.message, param=None))
        await sse.resp.write_eof()

    return await guarded_sse(request, engine, handles, request_id, write, write_error)
