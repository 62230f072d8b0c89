"""Streaming for the generation routes: engine deltas merged across requests, token tallies, and the SSE (or
NDJSON) stream that aborts whatever still runs when it ends (the client left, the engine died, or done)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.errors import AioEngineError
from aioengine.http.errors import APIError, api_error, error_dict
from aioengine.http.parsing import ChatRequest, CompletionRequest
from aioengine.outputs import CompletionOutput, RequestOutput

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JSON = dict[str, Any]
W = TypeVar("W", "SSEWriter", "NDJSONWriter")


async def merged(handles: Sequence[RequestHandle]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The deltas of several requests as they come, tagged with the request's position.

    Closing this generator (or cancelling its consumer) aborts every request still running.
    """
    if len(handles) == 1:
        async with aclosing(handles[0].__aiter__()) as it:
            async for out in it:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
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

    @classmethod
    def of(cls, outs: Sequence[RequestOutput]) -> Tally:
        """The counts of finished outputs."""
        return cls(
            [len(o.prompt_token_ids) for o in outs],
            [o.num_cached_tokens for o in outs],
            sum(o.num_generated_tokens for o in outs),
        )

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = max(self.cached_tokens[i], out.num_cached_tokens)
        self.completion_tokens += sum(len(c.token_ids) for c in out.outputs)

    def usage(self) -> JSON:
        prompt = sum(self.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }


class SSEWriter:
    """Writes `data: <json>` events; a vanished client raises ConnectionResetError from write()."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp

    @staticmethod
    def _data(obj: JSON) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    @staticmethod
    def _named(obj: JSON) -> bytes:
        return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

    async def send(self, obj: JSON) -> None:
        await self.resp.write(self._data(obj))

    async def send_event(self, obj: JSON) -> None:
        """A named event (`event: <type>`), as the Responses and Anthropic APIs stream them."""
        await self.resp.write(self._named(obj))

    async def done(self, *last: JSON) -> None:
        """``last`` events, [DONE] and the end of the body in one write: a stream's end is one syscall."""
        await self.resp.write_eof(b"".join(map(self._data, last)) + b"data: [DONE]\n\n")

    async def done_named(self, *last: JSON) -> None:
        """``last`` named events and the end of the body in one write (those APIs send no [DONE])."""
        await self.resp.write_eof(b"".join(map(self._named, last)))


class NDJSONWriter:
    """Writes one JSON object a line (Ollama's streams); a vanished client raises ConnectionResetError."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp

    async def send(self, obj: JSON) -> None:
        await self.resp.write(orjson.dumps(obj) + b"\n")

    async def done(self, *last: JSON) -> None:
        await self.resp.write_eof(b"".join(orjson.dumps(o) + b"\n" for o in last))


NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}


async def guarded_sse(
    request: web.Request,
    engine: EngineClient,
    handles: Sequence[RequestHandle],
    request_id: str,
    write: Callable[[SSEWriter], Awaitable[None]],
    write_error: Callable[[SSEWriter, APIError], Awaitable[None]],
) -> web.StreamResponse:
    """Open the stream, run ``write``; a vanished client ends it quietly, a dead engine gets ``write_error``;
    whatever is still running is aborted at the end, also when the stream never opened."""
    return await guarded_stream(
        request, engine, handles, request_id, write, write_error, SSE_HEADERS, SSEWriter
    )


async def guarded_stream(
    request: web.Request,
    engine: EngineClient,
    handles: Sequence[RequestHandle],
    request_id: str,
    write: Callable[[W], Awaitable[None]],
    write_error: Callable[[W, APIError], Awaitable[None]],
    headers: Mapping[str, str],
    writer: Callable[[web.StreamResponse], W],
) -> web.StreamResponse:
    """guarded_sse for any body format: ``writer`` wraps the response (SSE, NDJSON)."""
    try:
        resp = web.StreamResponse(headers={**headers, "X-Request-Id": request_id})
        await resp.prepare(request)
    except BaseException:
        await abort_all(engine, handles)
        raise
    sse = writer(resp)
    try:
        await write(sse)
    except ConnectionResetError:
        pass  # the client left; its requests are aborted below
    except AioEngineError as e:
        with suppress(ConnectionResetError):
            await write_error(sse, api_error(e))
    finally:
        await abort_all(engine, handles)
    return resp


async def abort_all(engine: EngineClient, handles: Sequence[RequestHandle]) -> None:
    """Abort whatever is still running (a no-op for finished requests), also when never iterated."""
    for h in handles:
        await engine.abort(h.request_id)


# A choice's chunk from one delta of request i (None: nothing to send for it).
ChoiceMaker = Callable[[int, CompletionOutput, RequestOutput], JSON | None]


async def stream_choices(
    request: web.Request,
    engine: EngineClient,
    req: ChatRequest | CompletionRequest,
    handles: Sequence[RequestHandle],
    request_id: str,
    base: JSON,
    first: list[JSON],
    make_choice: ChoiceMaker,
    on_output: Callable[[int, RequestOutput], None] | None = None,
) -> web.StreamResponse:
    """The SSE stream of chat and text completions: ``first`` chunks, then one chunk per changed choice,
    usage last (when asked), then [DONE]."""
    tally = Tally([0] * len(handles), [0] * len(handles))

    async def write(sse: SSEWriter) -> None:
        async with aclosing(merged(handles)) as deltas:
            for chunk in first:
                await sse.send({**base, "choices": [chunk]})
            async for i, out in deltas:
                tally.add(i, out)
                if on_output is not None:
                    on_output(i, out)
                for c in out.outputs:
                    if (
                        not c.text
                        and c.finish_reason is None
                        and (req.params.logprobs is None or not c.token_ids)
                    ):
                        continue  # the detokenizer is holding text back: nothing to say yet
                    choice = make_choice(i, c, out)
                    if choice is None:
                        continue
                    chunk = {**base, "choices": [choice]}
                    if req.continuous_usage_stats:
                        chunk["usage"] = tally.usage()
                    await sse.send(chunk)
        await sse.done(*([{**base, "choices": [], "usage": tally.usage()}] if req.include_usage else []))

    async def write_error(sse: SSEWriter, err: APIError) -> None:
        await sse.done(error_dict(err.status, err.message, code=err.code))

    return await guarded_sse(request, engine, handles, request_id, write, write_error)
