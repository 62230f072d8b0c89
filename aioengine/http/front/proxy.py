"""The front's HTTP server: every request forwarded to a replica, its response streamed back byte for
byte; /metrics gathers the replicas' (each sample labelled with its ``replica``) beside the router's own
counters; /health is 200 while every replica serves.

A generation request (a POST with a JSON body) goes where PrefixRouter says; anything else to the least
loaded replica. A replica that dies mid-stream ends that stream with an error event in the stream's own
format (SSE ``data: {"error": ...}``, or an NDJSON line); before any byte it is a 503. Other streams never
notice. The front parses nothing but the body's prompt fields, and never touches a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from aioengine.http.anthropic.messages import is_messages_path
from aioengine.http.app import route_error
from aioengine.http.errors import APIError
from aioengine.http.front.replicas import Replica, ReplicaSet
from aioengine.http.front.router import PrefixRouter, prefix_text

logger = logging.getLogger("aioengine.front")

REPLICAS = web.AppKey("replicas", ReplicaSet)
ROUTER = web.AppKey("router", PrefixRouter)
SESSION = web.AppKey("session", aiohttp.ClientSession)
# Hop-by-hop headers, and the ones aiohttp sets itself for the new message
HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade"})


def end_to_end(
    headers: Iterable[tuple[str, str]], drop: frozenset[str] = HOP_BY_HOP
) -> list[tuple[str, str]]:
    """The headers a proxy passes on: all but ``drop`` (the hop-by-hop ones), repeated ones kept."""
    return [(k, v) for k, v in headers if k.lower() not in drop]


def build_front(
    replicas: ReplicaSet, router: PrefixRouter, client_max_size: int = 32 << 20
) -> web.Application:
    app = web.Application(client_max_size=client_max_size)
    app[REPLICAS], app[ROUTER] = replicas, router
    app.cleanup_ctx.append(_session)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def _session(app: web.Application) -> Any:
    # no total timeout: a stream lasts as long as its generation; no cap on connections (aiohttp's 100 would
    # hold the 101st stream back, unseen by the replicas and their queue limits)
    app[SESSION] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        auto_decompress=False,
    )
    yield
    await app[SESSION].close()


def _error(status: int, message: str, path: str = "") -> web.Response:
    """The front's own error, in the route family's shape (Anthropic's, Ollama's, else OpenAI's)."""
    return route_error(path, APIError(status, message))


async def forward(request: web.Request) -> web.StreamResponse:
    replicas, router = request.app[REPLICAS].replicas, request.app[ROUTER]
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return await _websocket(request)
    body = await request.read()
    text = ""
    if request.method == "POST" and body[:1] == b"{":
        with contextlib.suppress(ValueError):
            text = prefix_text(orjson.loads(body))
    try:
        d = router.choose(text, [r.load for r in replicas], [r.healthy for r in replicas])
    except LookupError:
        return _error(503, "no replica is serving (they are starting or restarting)", request.path)
    r = replicas[d.replica]
    if text:  # taken as held from now on, as SGLang's router does: a burst sharing a prefix follows it
        router.record(text, r.index)
    r.load += 1
    try:
        return await _relay(request, r, body)
    finally:
        r.load -= 1


async def _relay(request: web.Request, r: Replica, body: bytes) -> web.StreamResponse:
    headers = end_to_end(request.headers.items())
    url = r.url + request.rel_url.path_qs
    resp: web.StreamResponse | None = None
    kind = ""
    try:
        async with request.app[SESSION].request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        ) as up:
            out = end_to_end(up.headers.items())
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out)
            kind = up.headers.get("Content-Type", "")
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        message = f"replica {r.index} failed while serving the request ({type(e).__name__}): retry it"
        logger.warning("%s %s: %s", request.method, request.path, message)
        if resp is None or not resp.prepared:
            return _error(503, message, request.path)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof(stream_error(request.path, kind, message))
        return resp


def stream_error(path: str, content_type: str, message: str) -> bytes:
    """The last bytes of a stream whose replica died, in its API's stream format: Ollama's NDJSON line,
    Anthropic's and the Responses API's named ``error`` event, or chat's ``data:`` error object."""
    if "ndjson" in content_type:
        return orjson.dumps({"error": message}) + b"\n"
    event: dict[str, Any] | None = None
    if is_messages_path(path):
        event = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    elif path.startswith("/v1/responses"):
        event = {"type": "error", "code": "engine_dead", "message": message, "param": None}
    if event is not None:
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return (
        b"data: "
        + orjson.dumps({"error": {"message": message, "type": "engine_dead", "code": 503}})
        + b"\n\n"
    )


async def _websocket(request: web.Request) -> web.StreamResponse:
    """A websocket (/v1/ws) joined to one replica's for its life: messages pumped both ways; the replica's
    close (or death) closes the client's, and the other way round."""
    replicas, router = request.app[REPLICAS].replicas, request.app[ROUTER]
    try:
        d = router.choose("", [r.load for r in replicas], [r.healthy for r in replicas])
    except LookupError:
        return _error(503, "no replica is serving (they are starting or restarting)")
    r = replicas[d.replica]
    headers = {
        k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key", "origin")
    }
    try:
        upstream = await request.app[SESSION].ws_connect(r.url + request.rel_url.path_qs, headers=headers)
    except aiohttp.WSServerHandshakeError as e:
        return _error(e.status, e.message or "websocket refused")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(503, f"replica {r.index} refused the websocket ({type(e).__name__})")
    client = web.WebSocketResponse()
    r.load += 1

    async def pump(src: Any, dst: Any) -> None:
        async for msg in src:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            else:
                break

    try:
        await client.prepare(request)
        tasks = [asyncio.create_task(pump(client, upstream)), asyncio.create_task(pump(upstream, client))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        r.load -= 1
        await upstream.close()
        await client.close()
    return client


async def health(request: web.Request) -> web.Response:
    replicas = request.app[REPLICAS].replicas
    if all(r.healthy for r in replicas):
        return web.Response(status=200)
    states = {str(r.index): "serving" if r.healthy else "down" for r in replicas}
    return web.Response(
        status=503,
        body=orjson.dumps({"error": {"message": "a replica is down", "replicas": states}}),
        content_type="application/json",
    )


async def metrics(request: web.Request) -> web.Response:
    """Every replica's samples with a ``replica`` label, then the router's and the replicas' states."""
    replicas, router, session = request.app[REPLICAS].replicas, request.app[ROUTER], request.app[SESSION]

    async def scrape(r: Replica) -> str:
        if not r.healthy:
            return ""
        try:
            async with session.get(r.url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return ""

    texts = await asyncio.gather(*(scrape(r) for r in replicas))
    seen: set[str] = set()
    lines: list[str] = []
    for r, text in zip(replicas, texts, strict=True):
        for line in text.splitlines():
            if line.startswith("#"):
                if line not in seen:  # HELP and TYPE once
                    seen.add(line)
                    lines.append(line)
            elif line:
                lines.append(_labelled(line, r.index))
    lines += decision_lines(router.decisions, "Routing decisions of the data-parallel front")
    lines += ["# TYPE aioengine:replica_up gauge", "# TYPE aioengine:replica_restarts_total counter"]
    for r in replicas:
        lines.append(f'aioengine:replica_up{{replica="{r.index}"}} {int(r.healthy)}')
        lines.append(f'aioengine:replica_restarts_total{{replica="{r.index}"}} {r.restarts}')
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def decision_lines(decisions: dict[str, int], help_text: str) -> list[str]:
    """A router's decision counts as Prometheus lines (this front's, and a Ray Serve ingress's router)."""
    lines = [
        f"# HELP aioengine:router_decisions_total {help_text}",
        "# TYPE aioengine:router_decisions_total counter",
    ]
    return lines + [f'aioengine:router_decisions_total{{decision="{k}"}} {v}' for k, v in decisions.items()]


def _labelled(sample: str, replica: int) -> str:
    name, sep, rest = sample.partition("{")
    if sep:
        return f'{name}{{replica="{replica}",{rest}'
    name, _, value = sample.partition(" ")
    return f'{name}{{replica="{replica}"}} {value}'
