"""The aiohttp app: its route table, auth and error middleware, and its lifecycle (metrics, the GC freeze).

The app runs in the engine's event loop: a request coroutine awaits its own engine output stream, with
no second process and no IPC hop. Serve it with `start_server`, which turns on handler cancellation so
that a client that disconnects aborts its request at once.

Each API family has its package: openai/ (chat, completions, responses, embeddings), anthropic/
(messages) and ollama/ (/api/*), generation going through admission.py and chat_output.py; ws.py is the
websocket, routes.py the rest (models, tokenize, health, metrics, the page); cors.py answers preflights.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from aioengine.engine import gc_freeze
from aioengine.engine.client import EngineClient, RequestInfo
from aioengine.engine.pool import ModelPool, PooledModel
from aioengine.errors import AioEngineError
from aioengine.http import cors, routes
from aioengine.http.anthropic import messages as anthropic_messages
from aioengine.http.context import (
    CONFIG,
    DEFAULT_MAX_BODY,
    ENGINE,
    POOL,
    STATE,
    AppState,
    ServerConfig,
    error_response,
    model_names,
)
from aioengine.http.errors import APIError, api_error
from aioengine.http.metrics import EngineMetrics, PoolMetrics
from aioengine.http.model_pool import (
    PooledEngine,
    add_load_header,
    load_model,
    pool_middleware,
    unload_model,
)
from aioengine.http.ollama import generate as ollama_generate
from aioengine.http.ollama import models as ollama_models
from aioengine.http.openai import embeddings as openai_embeddings
from aioengine.http.openai import lora as openai_lora
from aioengine.http.openai.chat import chat_completions
from aioengine.http.openai.completions import completions
from aioengine.http.openai.responses import responses
from aioengine.http.ws import websocket_handler
from aioengine.outputs import RequestOutput

# Re-exported: callers build apps with these.
__all__ = [
    "CONFIG",
    "DEFAULT_BACKLOG",
    "DEFAULT_MAX_BODY",
    "ENGINE",
    "STATE",
    "AccessLogger",
    "AppState",
    "ServerConfig",
    "bound_port",
    "build_app",
    "check_api_key",
    "route_error",
    "start_server",
]

logger = logging.getLogger("aioengine.http")

DEFAULT_BACKLOG = 2048  # a burst of connections beyond the listen backlog waits >= 1 s for a SYN retry
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    engine: EngineClient | None,
    config: ServerConfig | None = None,
    pool: ModelPool | None = None,
    **kwargs: Any,
) -> web.Application:
    """An aiohttp app serving a started (or soon started) engine, or with ``pool`` (and no engine) the pool's
    models, each request in the one it names; kwargs are ServerConfig fields."""
    cfg = config if config is not None else ServerConfig(**kwargs)
    app = web.Application(client_max_size=cfg.client_max_size, middlewares=[_middleware, pool_middleware])
    if pool is not None:
        assert engine is None, "a pool's app serves the pool's engines"
        app[POOL] = pool
        engine = PooledEngine(pool)  # each attribute is the request's engine's
        app.on_response_prepare.append(add_load_header)
    assert engine is not None
    app[ENGINE] = engine
    app[CONFIG] = cfg
    app[STATE] = AppState()
    app.cleanup_ctx.append(_lifecycle)
    if cfg.cors.enabled:
        app.on_response_prepare.append(_cors_headers)
    app.on_shutdown.append(_close_websockets)
    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", responses)
    r.add_post("/v1/messages", anthropic_messages.messages)
    r.add_post("/v1/messages/count_tokens", anthropic_messages.count_tokens)
    r.add_post("/v1/embeddings", openai_embeddings.embeddings)
    r.add_post("/v1/load_lora_adapter", openai_lora.load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", openai_lora.unload_lora_adapter)
    if pool is not None:
        r.add_post("/models/load", load_model)
        r.add_post("/models/unload", unload_model)
    r.add_post("/api/generate", ollama_generate.generate)
    r.add_post("/api/chat", ollama_generate.chat)
    r.add_post("/api/embed", ollama_models.embed)
    r.add_post("/api/show", ollama_models.show)
    r.add_get("/api/tags", ollama_models.tags)
    r.add_get("/api/ps", ollama_models.ps)
    r.add_get("/api/version", ollama_models.version)
    r.add_get("/v1/models", routes.list_models)
    r.add_get("/v1/models/{model:.+}", routes.get_model)
    r.add_get("/v1/ws", websocket_handler)
    r.add_post("/tokenize", routes.tokenize)
    r.add_post("/detokenize", routes.detokenize)
    r.add_get("/health", routes.health)
    r.add_get("/version", routes.version)
    r.add_get("/metrics", routes.metrics)
    r.add_get("/openapi.json", routes.openapi)
    r.add_get("/", routes.index)
    r.add_get("/static/{name}", routes.static_file)
    return app


async def start_server(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 5.0,
    access_log: logging.Logger | None = None,
    backlog: int = DEFAULT_BACKLOG,
) -> web.AppRunner:
    """Serve `app` on host:port in the running loop (port 0 picks a free one: see `bound_port`)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout,
        access_log=access_log,
        access_log_class=AccessLogger,
    )
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=backlog).start()
    return runner


class AccessLogger(AbstractAccessLogger):
    """One line per request, with a websocket's `?api_key=` redacted: the key never reaches the logs."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        url = request.rel_url
        if "api_key" in url.query:
            url = url.update_query(api_key="REDACTED")
        self.logger.info(
            '%s "%s %s HTTP/%d.%d" %d %d %.3fs',
            request.remote,
            request.method,
            url,
            request.version.major,
            request.version.minor,
            response.status,
            response.body_length,
            time,
        )


def bound_port(runner: web.AppRunner) -> int:
    port: int = runner.addresses[0][1]
    return port


# ---- lifecycle -------------------------------------------------------------------------------------------
async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    # What is alive now (the loaded model, tokenizer, libraries) leaves the cyclic GC while the app serves:
    # a full collection over it stalls the loop, a 503 burst or a token stream with it.
    gc_freeze.freeze(collect=False)
    pool = app.get(POOL)
    if pool is not None:
        async with _serving_pool(app, pool):
            yield
        return
    state, engine = app[STATE], app[ENGINE]
    metrics = state.metrics = EngineMetrics(engine, model_names(app)[0])
    state.lag_task = asyncio.create_task(
        metrics.watch_loop_lag(app[CONFIG].loop_lag_interval), name="aioengine-loop-lag"
    )
    if app[CONFIG].log_requests:
        engine.request_listeners.append(_log_finished)
    try:
        yield
    finally:
        state.lag_task.cancel()
        metrics.close()
        if _log_finished in engine.request_listeners:
            engine.request_listeners.remove(_log_finished)
        gc_freeze.unfreeze()


@contextlib.asynccontextmanager
async def _serving_pool(app: web.Application, pool: ModelPool) -> AsyncIterator[None]:
    """Several models: the pool's metrics, its keep_alive reaper, request logs on each engine it loads; its
    models unloaded when the app stops."""
    state = app[STATE]
    state.pool_metrics = PoolMetrics(pool)

    def on_pool(event: str, model: PooledModel) -> None:
        if event == "load" and model.engine is not None and app[CONFIG].log_requests:
            model.engine.request_listeners.append(_log_finished)

    pool.listeners.append(on_pool)
    pool.start()
    try:
        yield
    finally:
        await pool.close()
        pool.listeners.remove(on_pool)
        state.pool_metrics.close()
        gc_freeze.unfreeze()


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    cors.add_headers(request, response, request.app[CONFIG].cors)


async def _close_websockets(app: web.Application) -> None:
    app[STATE].draining = True
    for ws in list(app[STATE].websockets):
        await ws.close(code=1001, message=b"server shutting down")


def _log_finished(out: RequestOutput, state: RequestInfo) -> None:
    if out.finished:
        reasons = ",".join(f"{c.index}:{c.finish_reason}" for c in out.outputs)
        logger.info(
            "Finished request %s in %.3f s: prompt_tokens=%d finish=%s",
            out.request_id,
            time.monotonic() - state.arrival_time,
            len(out.prompt_token_ids),
            reasons,
        )


# ---- middleware: auth and errors ---------------------------------------------------------------------
def _needs_auth(path: str) -> bool:
    return path.startswith(("/v1/", "/api/", "/models/")) or path in ("/v1", "/tokenize", "/detokenize")


def check_api_key(request: web.Request, key: str) -> None:
    header = request.headers.get("Authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else None
    if token is None:
        token = request.headers.get("x-api-key")  # Anthropic's clients send the key here
    if token is None and request.path == "/v1/ws":
        token = request.query.get("api_key")  # browsers cannot set headers on a websocket
    if token is None or not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(
            401,
            "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Auth, then the handler; every error becomes the route family's error JSON (Anthropic's shape on
    /v1/messages, Ollama's on /api/*, OpenAI's elsewhere)."""
    try:
        answer = cors.preflight(request, request.app[CONFIG].cors)  # before auth: it carries no key
        if answer is not None:
            return answer
        key = request.app[CONFIG].api_key
        if key and _needs_auth(request.path):
            check_api_key(request, key)
        return await handler(request)
    except APIError as e:
        return _error(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"Not found: {request.method} {request.path}"
        elif e.status == 405:
            message = f"Method {request.method} is not allowed on {request.path}."
        else:
            message = e.text or e.reason
        headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        return _error(request, APIError(e.status, message, headers=headers))
    except AioEngineError as e:
        return _error(request, api_error(e))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client left (e.g. while SSE headers were written): answer no one
        return web.Response(status=499)  # aiohttp drops it quietly; an exception would log an error and a 500
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return _error(request, APIError(500, "Internal server error."))


def _error(request: web.Request, err: APIError) -> web.Response:
    return route_error(request.path, err)


def route_error(path: str, err: APIError) -> web.Response:
    """``err`` as the error JSON of the API family ``path`` belongs to (the data-parallel front's too)."""
    if anthropic_messages.is_messages_path(path):
        return anthropic_messages.anthropic_error(err)
    if path.startswith("/api/"):
        return ollama_generate.ollama_error(err)
    return error_response(err)
