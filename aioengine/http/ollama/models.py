"""Ollama's model routes: GET /api/tags, /api/ps and /api/version, POST /api/show and /api/embed.

One engine serves one model (and its LoRA adapters), loaded for the server's life: tags and ps list the
same models, ps with an expiry far ahead. Details come from the model's folder (config.json) where the
engine names one; a digest is the sha256 of the served name and the path, not of the weights (reading
gigabytes to answer a listing is not worth it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from aioengine.errors import AioEngineError
from aioengine.http import admission
from aioengine.http.context import CONFIG, ENGINE, LOAD_SECONDS, POOL, json_response, model_names, served_path
from aioengine.http.errors import api_error, bad
from aioengine.http.ollama.generate import served_model
from aioengine.http.parsing import parse_prompt
from aioengine.http.streaming import JSON
from aioengine.version import __version__


def _config(path: str | None) -> JSON:
    if path is None:
        return {}
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _size(path: str | None) -> int:
    if path is None or not os.path.exists(path):
        return 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        f.stat().st_size for f in Path(path).iterdir() if f.suffix in (".safetensors", ".gguf", ".bin")
    )


def _details(path: str | None) -> JSON:
    config = _config(path)
    family = str(config.get("model_type", ""))
    return {
        "parent_model": "",
        "format": "gguf" if path and path.endswith(".gguf") else "safetensors",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": str(config.get("torch_dtype") or config.get("dtype") or ""),
    }


def _entry(app: web.Application, name: str) -> JSON:
    path = served_path(app, name)
    modified = os.path.getmtime(path) if path and os.path.exists(path) else time.time()
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(modified, UTC).isoformat(),
        "size": _size(path),
        "digest": hashlib.sha256(f"{name}\0{path}".encode()).hexdigest(),
        "details": _details(path),
    }


async def tags(request: web.Request) -> web.Response:
    return json_response({"models": [_entry(request.app, n) for n in model_names(request.app)]})


async def ps(request: web.Request) -> web.Response:
    """The loaded models, each with when its keep_alive runs out (years ahead: never, or held by a request);
    one model is loaded for the server's life."""
    never = datetime.now(UTC) + timedelta(days=365 * 100)
    pool = request.app.get(POOL)
    models = []
    for n in model_names(request.app):
        expires = never
        if pool is not None:
            model = pool.get(n)
            if model.engine is None:
                continue
            if model.active == 0 and model.expires is not None:
                expires = datetime.now(UTC) + timedelta(seconds=max(model.expires - time.monotonic(), 0.0))
        entry = _entry(request.app, n)
        models.append({**entry, "expires_at": expires.isoformat(), "size_vram": 0})
    return json_response({"models": models})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def show(request: web.Request) -> web.Response:
    data = await admission.read_json(request)
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    name = served_model(request.app, data.get("model") or data.get("name"))
    engine = request.app[ENGINE]
    config = _config(engine.model_path)
    template = getattr(engine.tokenizer, "chat_template", None)
    info: dict[str, Any] = {"general.architecture": config.get("model_type", "")}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key in config:
            info[f"{config.get('model_type', 'model')}.{key}"] = config[key]
    info["context_length"] = engine.max_model_len
    return json_response(
        {
            "modelfile": f"FROM {engine.model_path or name}\n",
            "parameters": "",
            "template": template if isinstance(template, str) else "",
            "details": _details(engine.model_path),
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": _entry(request.app, name)["modified_at"],
        }
    )


async def embed(request: web.Request) -> web.Response:
    """``{"embeddings": [[...]]}`` for a string or a list of them (unit vectors, as Ollama gives)."""
    app = request.app
    admission.check_capacity(app)
    data = await admission.read_json(request)
    if not isinstance(data, dict):
        raise bad("The request body must be a JSON object.")
    model = served_model(app, data.get("model"))
    inputs = data.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(x, str) and x for x in inputs):
        raise bad("input must be a non-empty string or a list of them", "input")
    inputs = parse_prompt(inputs, app[CONFIG].limits, "input")  # /v1/embeddings' limits on count and size
    dims = data.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or dims < 1):
        raise bad("dimensions must be a positive integer", "dimensions")
    started = time.monotonic()
    rid = admission.request_id(request.headers.get("X-Request-Id"), "ollama-embd")
    try:
        outs = await app[ENGINE].embed(inputs, dimensions=dims, request_id=rid)
    except AioEngineError as e:
        raise api_error(e) from None
    outs = outs if isinstance(outs, list) else [outs]
    return json_response(
        {
            "model": model,
            "embeddings": [list(o.outputs.embedding) for o in outs],
            "total_duration": int((time.monotonic() - started) * 1e9),
            "load_duration": int((request.get(LOAD_SECONDS) or 0.0) * 1e9),
            "prompt_eval_count": sum(len(o.prompt_token_ids) for o in outs),
        },
        headers={"X-Request-Id": rid},
    )
