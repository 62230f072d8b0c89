"""The routes besides generation: models, (de)tokenize, health, version, metrics, OpenAPI, the chat page."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aioengine.http import model_pool
from aioengine.http.admission import read_json
from aioengine.http.context import (
    CONFIG,
    ENGINE,
    POOL,
    STATE,
    STATIC_FILES,
    check_model,
    error_response,
    json_response,
    model_names,
)
from aioengine.http.errors import APIError, bad
from aioengine.http.openapi import openapi_spec
from aioengine.http.parsing import parse_detokenize_request, parse_tokenize_request
from aioengine.http.streaming import JSON
from aioengine.version import __version__

STATIC_DIR = Path(__file__).with_name("static")


def _model_card(app: web.Application, name: str) -> JSON:
    if POOL in app:
        return model_pool.model_card(app, name, app[STATE].created)
    engine = app[ENGINE]
    adapter = engine.lora_modules.get(name)  # a LoRA adapter's card names its base model as parent
    return {
        "id": name,
        "object": "model",
        "created": app[STATE].created,
        "owned_by": "aioengine",
        "root": adapter or engine.model_path or name,
        "parent": model_names(app)[0] if adapter is not None else None,
        "max_model_len": engine.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return json_response(
        {"object": "list", "data": [_model_card(request.app, n) for n in model_names(request.app)]}
    )


async def get_model(request: web.Request) -> web.Response:
    name = check_model(request.app, request.match_info["model"])
    return json_response(_model_card(request.app, name))


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    req = parse_tokenize_request(await read_json(request), request.app[CONFIG].limits)
    check_model(request.app, req.model)
    tok = engine.tokenizer
    if req.prompt is not None:
        ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    else:
        ids = engine.render_chat(req.messages or [], req.chat_template_kwargs)
    return json_response(
        {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        }
    )


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    vocab = engine.vocab_size or len(engine.tokenizer)
    model, tokens = parse_detokenize_request(await read_json(request), vocab)
    check_model(request.app, model)
    try:
        text = engine.tokenizer.decode(tokens)
    except Exception as e:  # ids the tokenizer has no piece for (padded vocabularies)
        raise bad(f"These tokens cannot be decoded: {e}", "tokens") from None
    return json_response({"prompt": text})


async def health(request: web.Request) -> web.Response:
    if POOL in request.app:  # several models: the server is up; a model's own failure is its requests'
        return web.Response(status=200)
    engine = request.app[ENGINE]
    if engine.dead_error is not None:
        return error_response(APIError(503, f"The engine is dead: {engine.dead_error}", code="engine_dead"))
    if not engine.is_running:
        return error_response(APIError(503, "The engine is not running.", code="engine_not_running"))
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.pool_metrics is not None:  # several models: each loaded one's, merged
        body = generate_latest(state.pool_metrics)  # it collects as a registry does
    else:
        assert state.metrics is not None, "set at startup"
        body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    if POOL in request.app:  # several models: token ids bounded by none of them in particular
        return json_response(openapi_spec(__version__, request.app[CONFIG].limits))
    engine = request.app[ENGINE]
    vocab = engine.vocab_size or len(engine.tokenizer)
    return json_response(openapi_spec(__version__, request.app[CONFIG].limits, vocab, engine.allow_priority))


async def static_file(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC_DIR / name, headers={"Cache-Control": "public, max-age=86400"})


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})
