"""vLLM's LoRA routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters
while serving (behind the API key as every /v1 route; refused unless --enable-lora-runtime-updates)."""

from __future__ import annotations

from aiohttp import web

from aioengine.errors import AioEngineError
from aioengine.http.admission import read_json
from aioengine.http.context import ENGINE
from aioengine.http.errors import APIError, api_error, bad

_NAME = {"type": "string", "minLength": 1}
# The bodies, declared here once (the parser below reads these keys; /openapi.json shows these schemas).
LOAD_LORA_SCHEMA = {
    "type": "object",
    "required": ["lora_name", "lora_path"],
    "properties": {"lora_name": _NAME, "lora_path": _NAME},
}
UNLOAD_LORA_SCHEMA = {"type": "object", "required": ["lora_name"], "properties": {"lora_name": _NAME}}


def _name(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise bad(f"`{key}` must be a non-empty string", key)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body = await read_json(request)
    name, path = _name(body, "lora_name"), _name(body, "lora_path")
    try:
        await engine.load_lora(name, path)
    except AioEngineError as e:
        raise api_error(e) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = _name(await read_json(request), "lora_name")
    if engine.allow_lora_updates and name not in engine.lora_modules:
        raise APIError(404, f"The LoRA adapter `{name}` does not exist.", "lora_name", "model_not_found")
    try:
        await engine.unload_lora(name)
    except AioEngineError as e:
        raise api_error(e) from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
