"""What every route module shares: the server's settings, the app's keys and state, and JSON replies."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from aioengine.engine.client import EngineClient
from aioengine.engine.pool import ModelPool
from aioengine.http.cors import CorsConfig
from aioengine.http.errors import APIError
from aioengine.http.schema import RequestLimits

if TYPE_CHECKING:  # metrics.py imports prometheus_client; only its type is named here
    from aioengine.http.metrics import EngineMetrics, PoolMetrics

DEFAULT_MAX_BODY = 4 << 20


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
    cors: CorsConfig = field(default_factory=CorsConfig)  # other origins' pages (none by default)
    reasoning_parser: str | None = (
        None  # qwen3 | deepseek_r1 | openai_gptoss: reasoning apart from the answer
    )
    # with a reasoning parser: a chat's structured-output constraint covers its think block too (vLLM's
    # enable_in_reasoning); by default it covers the answer after the block
    structured_outputs_in_reasoning: bool = False


@dataclass(slots=True, eq=False)
class AppState:
    """What the app learns at startup and changes while serving (the app itself is frozen by then)."""

    metrics: EngineMetrics | None = None
    pool_metrics: PoolMetrics | None = None  # serving several models (http/model_pool.py)
    lag_task: asyncio.Task[None] | None = None
    websockets: set[web.WebSocketResponse] = field(default_factory=set)
    draining: bool = False  # shutting down: new generations get 503
    created: int = field(default_factory=lambda: int(time.time()))


# The chat page's vendored libraries (npm's marked and DOMPurify, licenses beside them), served by name.
STATIC_FILES = frozenset({"marked.umd.js", "purify.min.js"})

ENGINE = web.AppKey[EngineClient]("aioengine_engine")
CONFIG = web.AppKey("aioengine_config", ServerConfig)
STATE = web.AppKey("aioengine_state", AppState)
# Serving several models (--models-dir): the pool, and the engine of the request being served, which
# app[ENGINE] (http/model_pool.py's PooledEngine) hands each call to.
POOL = web.AppKey("aioengine_pool", ModelPool)
CURRENT_ENGINE: contextvars.ContextVar[EngineClient | None] = contextvars.ContextVar(
    "aioengine_current_engine", default=None
)
LOAD_SECONDS = "aioengine_load_seconds"  # request key: the seconds this request waited for its model to load


def model_names(app: web.Application) -> list[str]:
    """The base model's served names, then the LoRA adapters' (a request's model picks one); with several
    models, each one's name."""
    pool = app.get(POOL)
    if pool is not None:
        return pool.names()
    return [*(app[CONFIG].served_model_names or [app[ENGINE].model_name]), *app[ENGINE].lora_modules]


def served_path(app: web.Application, name: str) -> str | None:
    """The file or folder a served name loads."""
    pool = app.get(POOL)
    return pool.get(name).path if pool is not None else app[ENGINE].model_path


def lora_of(app: web.Application, model: str) -> str | None:
    """The LoRA adapter a (checked) model name picks, or None for the base model."""
    if POOL in app:
        return None
    return model if model in app[ENGINE].lora_modules else None


def untagged(names: Collection[str], model: str) -> str | None:
    """``model`` among the ``names``: itself, or without Ollama's default tag ``:latest``; or None."""
    if model in names:
        return model
    base = model.removesuffix(":latest")
    return base if base in names else None


def check_model(app: web.Application, model: str | None) -> str:
    """The served name (or adapter) a request asks for (404 for another), or the first one."""
    names = model_names(app)
    if model is not None and POOL in app and (found := untagged(names, model)) is not None:
        return found  # the pool took Ollama's default tag off too (model_pool.py)
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return model or names[0]


def json_response(obj: object, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
    )


def error_response(err: APIError) -> web.Response:
    return json_response(err.to_dict(), err.status, err.headers)
