"""Serving several models from one app: each request's model picked from its body, the model routes, metrics.

The routes stay those of one model: ``app[ENGINE]`` is a ``PooledEngine`` that hands each call to the engine
of the request being served. A middleware reads the body's ``model`` (and ``keep_alive``), acquires that
model from the pool (loading it on its first request), serves the request in a context that names its
engine, and releases the model when the reply (a stream included) has ended. ``POST /models/load`` and
``/models/unload`` are llama.cpp's router's; the models' metrics are metrics.py's PoolMetrics.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from aioengine.engine.client import EngineClient
from aioengine.engine.pool import ModelPool, parse_keep_alive
from aioengine.errors import EngineNotStartedError, InvalidRequestError
from aioengine.http.admission import check_draining, read_json
from aioengine.http.context import CURRENT_ENGINE, LOAD_SECONDS, POOL, json_response, untagged
from aioengine.http.errors import bad
from aioengine.http.ollama.generate import empty_reply

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The routes whose JSON body names a model: each request holds its model for as long as it is served.
POOLED_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/api/generate",
        "/api/chat",
        "/api/embed",
        "/api/show",
        "/tokenize",
        "/detokenize",
    }
)
LOAD_HEADER = "X-Model-Load-Seconds"  # on a reply whose request waited for its model to load


class PooledEngine:
    """``app[ENGINE]`` with several models: every attribute is the current request's engine's."""

    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool

    @staticmethod
    def _engine() -> EngineClient:
        engine = CURRENT_ENGINE.get()
        if engine is None:
            raise EngineNotStartedError("this server runs several models: a request names one with `model`")
        return engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine(), name)

    @property
    def lora_modules(self) -> dict[str, str]:  # adapters are one model's; several models serve none
        return {}

    @property
    def allow_lora_updates(self) -> bool:
        return False

    async def load_lora(self, name: str, path: str) -> None:
        raise InvalidRequestError("A server of several models serves no LoRA adapters.", "lora_name")

    async def unload_lora(self, name: str) -> None:
        raise InvalidRequestError("A server of several models serves no LoRA adapters.", "lora_name")


def resolve_name(pool: ModelPool, model: object) -> str:
    """The served name a body's ``model`` picks: itself, or without Ollama's ``:latest``; the first served
    model when the body names none (as with one model)."""
    names = pool.names()
    if model is None or model == "":
        return names[0]
    if not isinstance(model, str):
        raise bad("model must be a string", "model")
    return untagged(pool.models, model) or model  # an unknown name: the pool's 404 says which exist


def _body(raw: bytes) -> dict | None:
    """The body as a JSON object, or None (the route's own parser says why, with its 400)."""
    try:
        data = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _unloads(path: str, data: dict, keep_alive: float | None) -> bool:
    """Ollama's unload (``ollama stop``): /api/generate or /api/chat with no prompt and keep_alive 0."""
    if keep_alive != 0 or path not in ("/api/generate", "/api/chat"):
        return False
    return not (data.get("messages") if path == "/api/chat" else data.get("prompt"))


@web.middleware
async def pool_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Serve a request that names a model in that model's engine, holding it until the reply has ended (with
    one model: only check a ``keep_alive``, which it has no use for)."""
    if request.method != "POST" or request.path not in POOLED_ROUTES:
        return await handler(request)
    pool = request.app.get(POOL)
    raw = await request.read()
    if pool is None and b"keep_alive" not in raw:
        return await handler(request)
    data = _body(raw)
    if data is None:  # no model to pick: the route answers its 400 (one model), or the same 400 here
        if pool is None:
            return await handler(request)
        raise bad("The request body must be a JSON object.")
    try:
        keep_alive = parse_keep_alive(data.get("keep_alive"))
    except ValueError as e:
        raise bad(str(e), "keep_alive") from None
    if pool is None:
        return await handler(request)
    check_draining(request.app)  # before any load
    name = resolve_name(pool, data.get("model") or data.get("name"))
    if _unloads(request.path, data, keep_alive):  # unload without loading it first
        await pool.unload(pool.get(name).name)
        return json_response(empty_reply(name, request.path == "/api/chat", "unload"))
    engine, load_s = await pool.acquire(name)
    request[LOAD_SECONDS] = load_s
    token = CURRENT_ENGINE.set(engine)
    try:
        return await handler(request)
    finally:
        CURRENT_ENGINE.reset(token)
        pool.release(name, keep_alive)


async def add_load_header(request: web.Request, response: web.StreamResponse) -> None:
    load_s = request.get(LOAD_SECONDS)
    if load_s is not None:
        response.headers[LOAD_HEADER] = f"{load_s:.3f}"


def model_card(app: web.Application, name: str, created: int) -> dict[str, Any]:
    """``/v1/models``'s card of a served model, with whether it is loaded now."""
    model = app[POOL].get(name)
    engine = model.engine
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "aioengine",
        "root": model.path,
        "parent": None,
        "max_model_len": engine.max_model_len if engine is not None else None,
        "loaded": engine is not None,
        "status": "loading"
        if model.loading is not None
        else "loaded"
        if engine is not None
        else "unloading"
        if model.unloading is not None
        else "unloaded",
    }


async def _model_request(request: web.Request) -> tuple[ModelPool, str]:
    data = await read_json(request)
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    pool = request.app[POOL]
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model must name a served model", "model")
    name = resolve_name(pool, model)
    pool.get(name)  # 404 for a name it does not serve
    return pool, name


async def load_model(request: web.Request) -> web.Response:
    """``POST /models/load {"model": NAME}``: load it now (its keep_alive then runs from here)."""
    pool, name = await _model_request(request)
    seconds = await pool.load(name)
    return json_response({"success": True, "model": name, "load_seconds": round(seconds, 3)})


async def unload_model(request: web.Request) -> web.Response:
    """``POST /models/unload {"model": NAME}``: unload it once its requests are done."""
    pool, name = await _model_request(request)
    was_loaded = await pool.unload(name)
    return json_response({"success": True, "model": name, "unloaded": was_loaded})
