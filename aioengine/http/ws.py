"""The websocket endpoint (/v1/ws): many streamed generations over one socket, cancellable by message.

Protocol (docs/websocket.md): the client sends {"type": "chat" | "completion", "id", "body"},
{"type": "cancel", "id"} or {"type": "ping"}; the server answers with "start", "delta" ... "done" (with
usage) per generation, "error", and "pong". A closed socket aborts everything it started. A binary frame
closes the socket with 1003, a message over --max-request-bytes with 1009.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import aclosing, suppress

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.engine.pool import ModelPool, parse_keep_alive
from aioengine.errors import AioEngineError
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.chat_output import ChatOutputParser, Reasoning
from aioengine.http.context import CONFIG, CURRENT_ENGINE, ENGINE, POOL, STATE
from aioengine.http.errors import APIError, api_error, bad
from aioengine.http.logprobs import chat_logprobs
from aioengine.http.model_pool import resolve_name
from aioengine.http.openai.chat import parse_chat_request
from aioengine.http.openai.completions import parse_completion_request, prompt_text
from aioengine.http.parsing import ChatRequest, CompletionRequest
from aioengine.http.schema import parse_json_body
from aioengine.http.streaming import JSON, Tally, abort_all, merged

MAX_ACTIVE_PER_SOCKET = 64
_KINDS = ("chat", "completion")


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    app = request.app
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=app[CONFIG].client_max_size, compress=False)
    await ws.prepare(request)
    session = _Session(app, ws)
    app[STATE].websockets.add(ws)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await session.on_message(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await ws.close(
                    code=WSCloseCode.UNSUPPORTED_DATA, message=b"send JSON text frames, not binary"
                )
                break
            elif (
                msg.type == WSMsgType.ERROR
            ):  # aiohttp has closed it: 1009 (too big) or 1002/1007 (bad frame)
                break
    finally:
        app[STATE].websockets.discard(ws)
        await session.close()
    return ws


class _Session:
    """One socket: its running generations by client id, and one lock so frames never interleave."""

    def __init__(self, app: web.Application, ws: web.WebSocketResponse) -> None:
        self.app = app
        self.engine = app[ENGINE]
        self.ws = ws
        # each generation's task, handles and engine (several models: the one its body named, once loaded)
        self.active: dict[str, tuple[asyncio.Task[None], list[RequestHandle], list[EngineClient]]] = {}
        self.send_lock = asyncio.Lock()
        self.next_id = 0

    async def send(self, obj: JSON) -> None:
        async with self.send_lock:
            await self.ws.send_str(orjson.dumps(obj).decode())

    async def send_error(self, gen_id: str | None, err: APIError) -> None:
        d = err.to_dict()["error"]
        d["status"] = err.status
        await self.send({"type": "error", "id": gen_id, "error": d})

    async def on_message(self, text: str) -> None:
        gen_id = None
        try:
            msg = parse_json_body(text, self.app[CONFIG].limits.max_json_depth, "message")
            gen_id = msg.get("id")
            if isinstance(gen_id, bool) or (gen_id is not None and not isinstance(gen_id, str | int)):
                gen_id = None
                raise bad("id must be a string or an integer.", "id")
            gen_id = None if gen_id is None else str(gen_id)
            kind = msg.get("type")
            if kind in _KINDS:
                gen_id = await self.start(kind, gen_id, msg)
            elif kind == "cancel":
                await self.cancel(gen_id)
            elif kind == "ping":
                await self.send({"type": "pong", "id": gen_id})
            else:
                raise bad(
                    f"Unknown message type {kind!r}: expected chat, completion, cancel or ping.", "type"
                )
        except APIError as e:
            await self.send_error(gen_id, e)
        except AioEngineError as e:
            await self.send_error(gen_id, api_error(e))

    async def start(self, kind: str, gen_id: str | None, msg: JSON) -> str:
        for key in msg:
            if key not in ("type", "id", "body"):
                raise bad(f"Unrecognized message field: {key}", key)
        if gen_id is None:
            self.next_id += 1
            gen_id = f"gen-{self.next_id}"
        if gen_id in self.active:
            raise bad(f"A generation with id {gen_id!r} is already running on this socket.", "id")
        if len(self.active) >= MAX_ACTIVE_PER_SOCKET:
            raise APIError(
                429,
                f"At most {MAX_ACTIVE_PER_SOCKET} generations may run on one socket.",
                code="too_many_generations",
            )
        body = msg.get("body")
        if not isinstance(body, dict):
            raise bad("body must be a JSON object: the same body as the HTTP route takes.", "body")
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}  # always streamed
        pool = self.app.get(POOL)
        if pool is None:
            adm, started = await self._admit(kind, body)
            task = asyncio.create_task(self.run(gen_id, adm, started))
            self.active[gen_id] = (task, started, [self.engine])
            return gen_id
        # Several models: the generation loads and holds the model its body names, in a task of its own (the
        # socket keeps reading cancels and pings meanwhile); its errors come as "error" messages.
        try:
            keep = parse_keep_alive(body.get("keep_alive"))
        except ValueError as e:
            raise bad(str(e), "keep_alive") from None
        name = pool.get(resolve_name(pool, body.get("model"))).name  # 404 now for a name it does not serve
        handles: list[RequestHandle] = []
        engines: list[EngineClient] = []
        task = asyncio.create_task(self._pooled(pool, name, keep, kind, gen_id, body, handles, engines))
        self.active[gen_id] = (task, handles, engines)
        return gen_id

    async def _admit(
        self, kind: str, body: JSON
    ) -> tuple[Admitted[ChatRequest] | Admitted[CompletionRequest], list[RequestHandle]]:
        admission.check_capacity(self.app)
        adm: Admitted[ChatRequest] | Admitted[CompletionRequest]
        if kind == "chat":
            adm = await admission.admit_body(self.app, body, parse_chat_request, None, "chatcmpl")
            return adm, [admission.start_chat(self.app, adm, "websocket chat")]
        adm = await admission.admit_body(self.app, body, parse_completion_request, None, "cmpl")
        return adm, await admission.start_completions(self.app, adm, "websocket completion")

    async def _pooled(
        self,
        pool: ModelPool,
        name: str,
        keep: float | None,
        kind: str,
        gen_id: str,
        body: JSON,
        handles: list[RequestHandle],
        engines: list[EngineClient],
    ) -> None:
        try:
            engine, _ = await pool.acquire(name)
        except AioEngineError as e:
            self.active.pop(gen_id, None)
            await self._try(self.send_error(gen_id, api_error(e)))
            return
        try:
            engines.append(engine)
            CURRENT_ENGINE.set(engine)  # this task's own context: app[ENGINE] is this model's engine here
            try:
                adm, started = await self._admit(kind, body)
            except (APIError, AioEngineError) as e:
                self.active.pop(gen_id, None)
                await self._try(self.send_error(gen_id, e if isinstance(e, APIError) else api_error(e)))
                return
            handles.extend(started)
            await self.run(gen_id, adm, handles)
        finally:
            pool.release(name, keep)

    async def run(
        self,
        gen_id: str,
        adm: Admitted[ChatRequest] | Admitted[CompletionRequest],
        handles: list[RequestHandle],
    ) -> None:
        req = adm.req
        n = req.params.n
        tally = Tally([0] * len(handles), [0] * len(handles))
        finish: dict[int, JSON] = {}
        chat = isinstance(req, ChatRequest)
        tools = req.tools if isinstance(req, ChatRequest) else None
        # --reasoning-parser: a chat's <think> text goes out apart, as each delta's "reasoning"; with tools,
        # the answer's text still streams, and its calls come parsed in "done"
        reasoning = self.app[CONFIG].reasoning_parser if chat else None
        parsers: dict[int, ChatOutputParser] = {}
        try:
            await self.send({"type": "start", "id": gen_id, "request_id": adm.request_id, "model": adm.model})
            async with aclosing(merged(handles)) as deltas:
                if isinstance(req, CompletionRequest) and req.echo:
                    for i, p in enumerate(req.prompts):
                        text = prompt_text(self.engine, p)
                        for j in range(n):
                            await self.send({"type": "delta", "id": gen_id, "index": i * n + j, "text": text})
                async for i, out in deltas:
                    tally.add(i, out)
                    for c in out.outputs:
                        index = i * n + c.index
                        parser = parsers.setdefault(index, ChatOutputParser(reasoning, tools))
                        events = parser.feed(c.text)
                        text = parser.answer_delta
                        if c.finish_reason is not None:
                            events += parser.finish(c.finish_reason)
                            text += parser.answer_delta
                        thought = "".join(e.text for e in events if isinstance(e, Reasoning))
                        if text or thought or c.token_ids:
                            delta = {
                                "type": "delta",
                                "id": gen_id,
                                "index": index,
                                "text": text,
                                "token_ids": c.token_ids,
                            }
                            if thought:
                                delta["reasoning"] = thought
                            if req.params.logprobs is not None:
                                delta["logprobs"] = chat_logprobs(
                                    self.engine, c.token_ids, c.logprobs, req.params.logprobs
                                )["content"]
                            await self.send(delta)
                        if c.finish_reason is not None:
                            finish[index] = {
                                "index": index,
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                            }
                            if parser.calls is not None:
                                parsed = parser.result()
                                finish[index]["finish_reason"] = parsed.finish_reason
                                finish[index].update(content=parsed.content, tool_calls=parsed.tool_calls)
            await self.send(
                {
                    "type": "done",
                    "id": gen_id,
                    "choices": [finish[k] for k in sorted(finish)],
                    "usage": tally.usage(),
                }
            )
        except AioEngineError as e:
            await self._try(self.send_error(gen_id, api_error(e)))
        except ConnectionResetError:
            pass  # the socket went away; its requests are aborted below
        finally:
            self.active.pop(gen_id, None)
            await abort_all(self.engine, handles)

    async def _try(self, coro: Awaitable[None]) -> None:
        with suppress(ConnectionResetError):
            await coro

    async def cancel(self, gen_id: str | None) -> None:
        entry = self.active.get(gen_id) if gen_id is not None else None
        if entry is None:
            raise APIError(
                404,
                f"No running generation with id {gen_id!r} on this socket.",
                "id",
                code="generation_not_found",
            )
        task, handles, engines = entry
        if not handles:  # its model still loading: no request to abort yet
            task.cancel()
        for h in handles:  # the stream then ends with finish_reason "abort" and a "done" message
            await engines[0].abort(h.request_id)

    async def close(self) -> None:
        entries = list(self.active.values())
        for task, _, _ in entries:
            task.cancel()
        for _, handles, engines in entries:  # a task cancelled before its first step never runs its finally
            if engines:
                await abort_all(engines[0], handles)
        if entries:
            await asyncio.gather(*(task for task, _, _ in entries), return_exceptions=True)
