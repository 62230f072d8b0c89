"""The aiohttp app: OpenAI routes, auth / backpressure / error middleware, metrics and the chat page.

The app runs in the engine's event loop: a request coroutine awaits its own engine output stream, with
no second process and no IPC hop. Serve it with `start_server`, which turns on handler cancellation so
that a client that disconnects aborts its request at once.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import aioengine
from aioengine.engine_client import EngineClient
from aioengine.errors import AioEngineError, InvalidRequestError
from aioengine.http import serving
from aioengine.http.metrics import EngineMetrics
from aioengine.http.openapi import openapi_spec
from aioengine.http.protocol import (
    APIError,
    ChatRequest,
    GenerationRequest,
    RequestLimits,
    bad,
    from_invalid,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_json_body,
    parse_tokenize_request,
)
from aioengine.http.responses import ResponseBuilder, to_chat_body
from aioengine.tokenizer import apply_chat_template

logger = logging.getLogger("aioengine.http")

STATIC_DIR = Path(__file__).with_name("static")
DEFAULT_MAX_BODY = 4 << 20
DEFAULT_BACKLOG = 2048  # a burst of connections beyond the listen backlog waits >= 1 s for a SYN retry
LOG_PROMPT_CHARS = 256  # --log-requests: how much of a prompt is logged


@dataclass(slots=True)
class ServerConfig:
    api_key: str | None = None  # every /v1 route (and /tokenize, /detokenize) then needs it
    max_num_queued_reqs: int | None = None  # waiting engine requests beyond which new ones get 503
    client_max_size: int = DEFAULT_MAX_BODY  # request bodies and websocket messages, in bytes
    served_model_names: list[str] = field(default_factory=list)  # default: the engine's model_name
    log_requests: bool = False
    loop_lag_interval: float = 0.05
    retry_after_s: int = 1
    limits: RequestLimits = field(default_factory=RequestLimits)  # caps on one request's fields (400 beyond)


@dataclass(slots=True, eq=False)
class AppState:
    """What the app learns at startup and changes while serving (the app itself is frozen by then)."""

    metrics: EngineMetrics | None = None
    lag_task: asyncio.Task | None = None
    websockets: set = field(default_factory=set)
    draining: bool = False  # shutting down: new generations get 503
    created: int = field(default_factory=lambda: int(time.time()))


_serving_apps = 0  # apps between startup and cleanup: the GC stays frozen while any serves
ENGINE = web.AppKey[EngineClient]("aioengine_engine")
CONFIG = web.AppKey("aioengine_config", ServerConfig)
STATE = web.AppKey("aioengine_state", AppState)


def build_app(engine: EngineClient, config: ServerConfig | None = None, **kwargs: Any) -> web.Application:
    """An aiohttp app serving a started (or soon started) AsyncEngine; kwargs are ServerConfig fields."""
    cfg = config if config is not None else ServerConfig(**kwargs)
    app = web.Application(client_max_size=cfg.client_max_size, middlewares=[_middleware])
    app[ENGINE] = engine
    app[CONFIG] = cfg
    app[STATE] = AppState()
    app.cleanup_ctx.append(_lifecycle)
    app.on_shutdown.append(_close_websockets)
    from aioengine.http.ws import websocket_handler

    r = app.router
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", responses)
    r.add_get("/v1/models", list_models)
    r.add_get("/v1/models/{model:.+}", get_model)
    r.add_get("/v1/ws", websocket_handler)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_get("/health", health)
    r.add_get("/version", version)
    r.add_get("/metrics", metrics)
    r.add_get("/openapi.json", openapi)
    r.add_get("/", index)
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
                       shutdown_timeout: float = 5.0, access_log: logging.Logger | None = None,
                       backlog: int = DEFAULT_BACKLOG) -> web.AppRunner:
    """Serve `app` on host:port in the running loop (port 0 picks a free one: see `bound_port`)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout,
                           access_log=access_log, access_log_class=AccessLogger)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=backlog).start()
    return runner


class AccessLogger(AbstractAccessLogger):
    """One line per request, with a websocket's `?api_key=` redacted: the key never reaches the logs."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        url = request.rel_url
        if "api_key" in url.query:
            url = url.update_query(api_key="REDACTED")
        self.logger.info('%s "%s %s HTTP/%d.%d" %d %d %.3fs', request.remote, request.method, url,
                         request.version.major, request.version.minor, response.status, response.body_length,
                         time)


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


async def _lifecycle(app: web.Application):
    # What is alive now (the loaded model, tokenizer, libraries) leaves the cyclic GC: a full collection over
    # it stalls the loop for ~0.2 s on a small CPU, a 503 burst or a token stream with it.
    global _serving_apps
    atexit.unregister(gc.unfreeze)  # registered once: if an app is never cleaned up, unfreeze at exit anyway
    atexit.register(gc.unfreeze)
    gc.freeze()
    _serving_apps += 1
    state, engine = app[STATE], app[ENGINE]
    state.metrics = EngineMetrics(engine, model_names(app)[0])
    state.lag_task = asyncio.create_task(state.metrics.watch_loop_lag(app[CONFIG].loop_lag_interval),
                                         name="aioengine-loop-lag")
    if app[CONFIG].log_requests:
        engine.request_listeners.append(_log_finished)
    yield
    state.lag_task.cancel()
    state.metrics.close()
    if _log_finished in engine.request_listeners:
        engine.request_listeners.remove(_log_finished)
    _serving_apps -= 1
    if not _serving_apps:  # the last one: at exit, a frozen heap would leak what needs collecting
        gc.unfreeze()


async def _close_websockets(app: web.Application) -> None:
    app[STATE].draining = True
    for ws in list(app[STATE].websockets):
        await ws.close(code=1001, message=b"server shutting down")


def _log_finished(out: Any, state: Any) -> None:
    if out.finished:
        reasons = ",".join(f"{c.index}:{c.finish_reason}" for c in out.outputs)
        logger.info("Finished request %s in %.3f s: prompt_tokens=%d finish=%s", out.request_id,
                    time.monotonic() - state.arrival_time, len(out.prompt_token_ids), reasons)


# ---- middleware: auth and errors ---------------------------------------------------------------------
def _needs_auth(path: str) -> bool:
    return path.startswith("/v1/") or path == "/v1" or path in ("/tokenize", "/detokenize")


def check_api_key(request: web.Request, key: str) -> None:
    header = request.headers.get("Authorization", "")
    token = header[7:] if header[:7].lower() == "bearer " else None
    if token is None and request.path == "/v1/ws":
        token = request.query.get("api_key")  # browsers cannot set headers on a websocket
    if token is None or not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json",
                        headers=headers)


def error_response(err: APIError) -> web.Response:
    return json_response(err.to_dict(), err.status, err.headers)


@web.middleware
async def _middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        key = request.app[CONFIG].api_key
        if key and _needs_auth(request.path):
            check_api_key(request, key)
        return await handler(request)
    except APIError as e:
        return error_response(e)
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
        return error_response(APIError(e.status, message, headers=headers))
    except InvalidRequestError as e:
        return error_response(from_invalid(e))
    except AioEngineError as e:
        return error_response(serving.engine_error(e))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client left (e.g. while SSE headers were written): answer no one
        return web.Response(status=499)  # aiohttp drops it quietly; an exception would log an error and a 500
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(APIError(500, "Internal server error."))


# ---- generation routes -------------------------------------------------------------------------------
def model_names(app: web.Application) -> list[str]:
    return app[CONFIG].served_model_names or [app[ENGINE].model_name]


def _check_model(app: web.Application, model: str | None) -> str:
    names = model_names(app)
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return model or names[0]


def admit(app: web.Application) -> None:
    """Backpressure: refuse at once, before reading the body, when the engine's queue is full."""
    if app[STATE].draining:
        raise APIError(503, "The server is shutting down.", code="shutting_down",
                       headers={"Retry-After": str(app[CONFIG].retry_after_s)})
    limit = app[CONFIG].max_num_queued_reqs
    if limit is None:
        return
    waiting = app[ENGINE].stats().num_waiting
    if waiting >= limit:
        raise APIError(503, f"The server is busy: {waiting} requests are already waiting "
                            f"(--max-num-queued-reqs {limit}). Retry later.", code="queue_full",
                       headers={"Retry-After": str(app[CONFIG].retry_after_s)})


def allow_priority(engine: EngineClient) -> bool:
    return engine.allow_priority


def _request_id(request: web.Request, req: GenerationRequest, prefix: str) -> str:
    return serving.new_request_id(request.headers.get("X-Request-Id") or req.request_id, prefix)


async def _read_json(request: web.Request) -> dict:
    return parse_json_body(await request.read(), request.app[CONFIG].limits.max_json_depth)


def log_start(app: web.Application, rid: str, req: GenerationRequest, what: str) -> None:
    """With --log-requests only: prompts and parameters never reach the logs otherwise."""
    if app[CONFIG].log_requests:
        prompt = req.messages if isinstance(req, ChatRequest) else req.prompts
        logger.info("Received request %s (%s): prompt=%.*s params=%s stream=%s user=%s", rid, what,
                    LOG_PROMPT_CHARS, repr(prompt), req.params, req.stream, req.user)


async def _admit_request(request: web.Request, parse: Any, id_prefix: str) -> tuple[Any, Any, str, str]:
    """Admission, parsing and prompt tokenization shared by the generation routes: (engine, req, model, rid)."""
    app = request.app
    admit(app)
    engine = app[ENGINE]
    req = parse(await _read_json(request), allow_priority(engine), app[CONFIG].limits,
                engine.default_sampling_params)
    model = _check_model(app, req.model)
    rid = _request_id(request, req, id_prefix)
    await serving.prepare(engine, req)
    admit(app)  # again: other requests may have queued while this body was read
    return engine, req, model, rid


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    engine, req, model, rid = await _admit_request(request, parse_chat_request, "chatcmpl")
    handles = serving.start_chat(engine, req, rid)
    log_start(app, rid, req, f"chat, {len(req.messages)} messages")
    if req.stream:
        return await serving.stream_chat(request, engine, req, handles, rid, model)
    outs = [await h for h in handles]
    return json_response(serving.chat_response(engine, req, rid, model, outs), headers={"X-Request-Id": rid})


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    engine, req, model, rid = await _admit_request(request, parse_completion_request, "cmpl")
    handles = await serving.start_completions(engine, req, rid)
    log_start(app, rid, req, f"completion, {len(req.prompts)} prompts")
    if req.stream:
        return await serving.stream_completions(request, engine, req, handles, rid, model)
    outs = list(await asyncio.gather(*handles))
    return json_response(serving.completion_response(engine, req, rid, model, outs),
                         headers={"X-Request-Id": rid})


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API for text (aioengine/http/responses.py): a chat request underneath."""
    seen: dict = {}

    def parse(data: dict, *args: Any) -> Any:
        seen["data"] = data
        return parse_chat_request(to_chat_body(data), *args)

    engine, req, model, rid = await _admit_request(request, parse, "resp")
    handles = serving.start_chat(engine, req, rid)
    log_start(request.app, rid, req, f"response, {len(req.messages)} messages")
    builder = ResponseBuilder(seen["data"], rid, model)
    if req.stream:
        return await serving.stream_response(request, engine, handles, rid, builder)
    out = await handles[0]
    return json_response(serving.response_object(builder, out), headers={"X-Request-Id": rid})


# ---- other routes ------------------------------------------------------------------------------------
def _model_card(app: web.Application, name: str) -> dict:
    engine = app[ENGINE]
    return {"id": name, "object": "model", "created": app[STATE].created, "owned_by": "aioengine",
            "root": engine.model_path or name, "parent": None,
            "max_model_len": engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app, n) for n in model_names(request.app)]})


async def get_model(request: web.Request) -> web.Response:
    name = _check_model(request.app, request.match_info["model"])
    return json_response(_model_card(request.app, name))


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = parse_tokenize_request(await _read_json(request), request.app[CONFIG].limits)
    _check_model(request.app, req.model)
    tok = engine.tokenizer
    if req.prompt is not None:
        ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    else:
        ids = apply_chat_template(tok, req.messages, **req.chat_template_kwargs)
    return json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                          "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None})


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    vocab = engine.vocab_size or len(engine.tokenizer)
    model, tokens = parse_detokenize_request(await _read_json(request), vocab)
    _check_model(request.app, model)
    try:
        text = engine.tokenizer.decode(tokens)
    except Exception as e:  # ids the tokenizer has no piece for (padded vocabularies)
        raise bad(f"These tokens cannot be decoded: {e}", "tokens") from None
    return json_response({"prompt": text})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.dead_error is not None:
        return error_response(APIError(503, f"The engine is dead: {engine.dead_error}", code="engine_dead"))
    if not engine.is_running:
        return error_response(APIError(503, "The engine is not running.", code="engine_not_running"))
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": aioengine.__version__})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    vocab = engine.vocab_size or len(engine.tokenizer)
    return json_response(openapi_spec(aioengine.__version__, request.app[CONFIG].limits, vocab,
                                      allow_priority(engine)))


async def index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})
