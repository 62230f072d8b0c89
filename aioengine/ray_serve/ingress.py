"""The Serve application's HTTP entry: each request for the engine's server (the OpenAI, Anthropic and
Ollama routes, /v1/models, /health, ...) sent to an engine replica through a DeploymentHandle, with its
prompt's block hashes for the router, and the replica's response streamed back as its app wrote it.

It does no model work beyond hashing prompts, with the tokenizer and template it fetches once from a replica.
A replica that dies mid-stream ends that stream with an error event in the stream's own format; before any
byte it is a 503 in the route family's error shape. ``/metrics`` here is the router's: its decisions and what
each replica last reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from aioengine.http.app import route_error
from aioengine.http.errors import APIError
from aioengine.http.front.proxy import decision_lines, end_to_end, stream_error
from aioengine.ray_serve.calls import HTTPCall, ResponseHead, RoutingInfo
from aioengine.ray_serve.prefix_index import ROUTERS
from aioengine.ray_serve.prompt_hashes import PROMPT_ROUTES, PromptHasher

logger = logging.getLogger("aioengine.ray_serve")

RETRY_INFO_S = 30.0  # after a failed fetch of the routing info, prompts go unhashed this long


def route_path(scope: Mapping[str, Any], raw: bool = False) -> str:
    """The path as the engine's server routes it: without the application's route prefix; ``raw``: as the
    client sent it (percent-escapes kept), to forward."""
    root = scope.get("root_path", "")
    path = scope.get("path", "/")
    if raw and scope.get("raw_path") is not None:
        path = scope["raw_path"].decode("latin-1")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


class Ingress:
    def __init__(self, engine: Any) -> None:
        """``engine``: the DeploymentHandle of the EngineReplica deployment."""
        self._engine = engine
        self._stream = engine.options(stream=True)
        self._hasher: PromptHasher | None = None
        self._info_failed_at = -RETRY_INFO_S
        self._info_lock = asyncio.Lock()

    async def __call__(self, request: Request) -> Response:
        path = route_path(request.scope)
        if path == "/metrics":
            return Response(self._metrics(), media_type="text/plain")
        if request.scope.get("type") == "websocket" or path == "/v1/ws":
            return _error(path, 404, "the websocket is not served through Ray Serve: use the HTTP routes")
        body = await request.body()
        hashes: list[int] = []
        if request.method == "POST" and path in PROMPT_ROUTES:
            hasher = await self._get_hasher()
            if hasher is not None:
                hashes = await asyncio.to_thread(hasher.hashes, path, body)
        query = request.scope.get("query_string", b"").decode("latin-1")
        target = route_path(request.scope, raw=True) + (f"?{query}" if query else "")
        headers = end_to_end((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw)
        stream = self._stream.forward.remote(HTTPCall(request.method, target, headers, body, hashes))
        try:
            head = await stream.__anext__()
        except Exception as e:  # Ray's errors: the replica died or could not be reached
            stream.cancel()
            logger.warning("%s %s: no replica answered: %r", request.method, path, e)
            return _error(path, 503, f"no engine replica answered the request ({type(e).__name__}): retry it")
        except BaseException:  # the client left first
            stream.cancel()
            raise
        assert isinstance(head, ResponseHead)
        kind = next((v for k, v in head.headers if k.lower() == "content-type"), "")
        response = StreamingResponse(_relay(stream, path, kind), status_code=head.status)
        response.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in head.headers]
        return response

    async def _get_hasher(self) -> PromptHasher | None:
        """The prompt hasher, made from a replica's routing info on first use."""
        if self._hasher is not None or time.monotonic() - self._info_failed_at < RETRY_INFO_S:
            return self._hasher
        async with self._info_lock:
            if self._hasher is None:
                try:
                    info: RoutingInfo = await self._engine.routing_info.remote()
                    self._hasher = await asyncio.to_thread(PromptHasher, info)
                except Exception as e:
                    logger.warning("no routing info from a replica (prompts are routed by load): %r", e)
                    self._info_failed_at = time.monotonic()
        return self._hasher

    def _metrics(self) -> str:
        app, name = self._engine.app_name, self._engine.deployment_name
        router = ROUTERS.get((app, name))
        # no request has gone through this ingress's handle yet: no router, no decisions
        lines = decision_lines(
            router.decisions if router else {}, "Routing decisions of the prefix-aware router"
        )
        if router is None:
            return "\n".join(lines) + "\n"
        lines += ["# TYPE aioengine:replica_cached_blocks gauge", "# TYPE aioengine:replica_load gauge"]
        for replica, report in sorted(router.index.reports.items()):
            lines.append(f'aioengine:replica_cached_blocks{{replica="{replica}"}} {len(report.hashes)}')
            lines.append(f'aioengine:replica_load{{replica="{replica}"}} {report.load}')
        return "\n".join(lines) + "\n"


async def _relay(stream: Any, path: str, content_type: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:  # the replica died mid-stream: this stream ends with an error; others go on
        logger.warning("%s: the replica failed mid-stream: %r", path, e)
        message = f"the engine replica failed while serving the request ({type(e).__name__})"
        yield stream_error(path, content_type, message)
    finally:
        stream.cancel()  # the client left, or the stream ended: nothing is left running on the replica


def _error(path: str, status: int, message: str) -> Response:
    r = route_error(path, APIError(status, message))
    assert r.body is not None
    return Response(bytes(r.body), status_code=r.status, media_type=r.content_type)  # type: ignore[arg-type]
