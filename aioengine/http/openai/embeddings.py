"""POST /v1/embeddings: OpenAI's embeddings route (a string, strings, token ids or lists of them; float or
base64 vectors; `dimensions`), one engine.embed() call for the whole input."""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass

from aiohttp import web

from aioengine.errors import AioEngineError
from aioengine.http import admission
from aioengine.http.context import CONFIG, ENGINE, check_model, json_response, lora_of
from aioengine.http.errors import api_error, bad
from aioengine.http.parsing import parse_prompt
from aioengine.http.request_tables import PROMPT, SAMPLING
from aioengine.http.schema import Fields, RequestLimits, Spec, Table
from aioengine.http.streaming import JSON


@dataclass(slots=True)
class EmbeddingRequest:
    model: str | None
    prompts: list[str | list[int]]
    single: bool  # one input (a string or one list of ids), not a list of them
    encoding_format: str
    dimensions: int | None
    request_id: str | None
    priority: int


def parse_embedding_request(data: JSON, allow_priority: bool, limits: RequestLimits) -> EmbeddingRequest:
    f = Fields(data, EMBEDDING, limits=limits)
    raw = data.get("input")
    prompts = parse_prompt(raw, limits, "input")
    priority = f.int("priority", 0)
    if priority and not allow_priority:
        raise bad("priority is only honoured with --scheduling-policy priority.", "priority")
    return EmbeddingRequest(
        f.str("model"),
        prompts,
        isinstance(raw, str) or (isinstance(raw, list) and type(raw[0]) is int),
        f.str("encoding_format", "float"),
        f.int("dimensions"),
        f.str("request_id"),
        priority,
    )


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()  # OpenAI's: float32, LE


async def embeddings(request: web.Request) -> web.Response:
    app = request.app
    admission.check_capacity(app)
    engine = app[ENGINE]
    body = await admission.read_json(request)
    req = parse_embedding_request(body, engine.allow_priority, app[CONFIG].limits)
    model = check_model(app, req.model)
    if lora_of(app, model) is not None:
        raise bad(f"embeddings of LoRA adapter {model!r} are not supported: ask the base model", "model")
    rid = admission.request_id(request.headers.get("X-Request-Id") or req.request_id, "embd")
    try:
        outs = await engine.embed(
            req.prompts[0] if req.single else req.prompts,
            dimensions=req.dimensions,
            request_id=rid,
            priority=req.priority,
        )
    except AioEngineError as e:
        err = api_error(e)
        if err.param == "prompt":
            err.param = "input"
        raise err from None
    outs = outs if isinstance(outs, list) else [outs]
    fmt = req.encoding_format
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    body = {
        "object": "list",
        "id": rid,
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(o.outputs.embedding, fmt)}
            for i, o in enumerate(outs)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return json_response(body, headers={"X-Request-Id": rid})


# ---- the request's fields (/openapi.json states them) ----------------------------------------------------
EMBEDDING: Table = {
    "model": Spec(str),
    "input": Spec(None, schema=lambda ctx: {**PROMPT.schema(ctx), "description": "at most max_prompts"}),
    "encoding_format": Spec(str, enum=("float", "base64")),
    "dimensions": Spec(int, lo=1, description="cut the unit vector to its first dimensions, renormalized"),
    "user": SAMPLING["user"],
    "keep_alive": SAMPLING["keep_alive"],
    "request_id": SAMPLING["request_id"],
    "priority": SAMPLING["priority"],
}


EMBEDDING_REQUIRED = ("input",)
