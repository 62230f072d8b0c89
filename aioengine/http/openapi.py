"""The OpenAPI 3.1 description of the server's routes, served at /openapi.json.

The request schemas are built from request_fields.py's tables, the ones the parsers read: unknown fields are
refused, null means the default, and the per-request caps are the server's RequestLimits. What a schema
cannot say (`n > 1` needs a temperature above 0, `stream_options` needs `stream`, a grammar must compile)
is in the descriptions.
"""

from __future__ import annotations

from functools import cache

from aioengine.http.anthropic.messages import COUNT_TOKENS_REQUEST, MESSAGES_REQUEST
from aioengine.http.context import STATIC_FILES
from aioengine.http.openai.chat import CHAT, CHAT_REQUIRED
from aioengine.http.openai.completions import COMPLETION, COMPLETION_REQUIRED
from aioengine.http.openai.embeddings import EMBEDDING, EMBEDDING_REQUIRED
from aioengine.http.openai.lora import LOAD_LORA_SCHEMA, UNLOAD_LORA_SCHEMA
from aioengine.http.openai.responses import RESPONSE, RESPONSE_REQUIRED
from aioengine.http.request_tables import DETOKENIZE, TOKENIZE, TOKENIZE_MESSAGES, TOKENIZE_PROMPT
from aioengine.http.schema import DEFAULT_LIMITS, JSON, RequestLimits, SchemaContext, object_schema

_STR, _INT = {"type": "string"}, {"type": "integer"}


def _schemas(limits: RequestLimits, vocab_size: int, priority: bool) -> JSON:
    """The request bodies, from request_fields.py's tables (the ones the parsers read)."""
    ctx = SchemaContext(limits, vocab_size, priority)
    error = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": _STR,
                    "type": _STR,
                    "param": {"anyOf": [_STR, {"type": "null"}]},
                    "code": {"anyOf": [_STR, _INT]},
                },
            }
        },
    }
    return {
        "ResponsesRequest": object_schema(RESPONSE, ctx, RESPONSE_REQUIRED),
        "ChatCompletionRequest": object_schema(CHAT, ctx, CHAT_REQUIRED),
        "CompletionRequest": object_schema(COMPLETION, ctx, COMPLETION_REQUIRED),
        "TokenizeRequest": {
            "oneOf": [
                object_schema(TOKENIZE, ctx, ("prompt",), only=TOKENIZE_PROMPT),
                object_schema(TOKENIZE, ctx, ("messages",), only=TOKENIZE_MESSAGES),
            ]
        },
        "DetokenizeRequest": object_schema(DETOKENIZE, ctx, ("tokens",)),
        "EmbeddingRequest": object_schema(EMBEDDING, ctx, EMBEDDING_REQUIRED),
        "LoadLoRAAdapterRequest": LOAD_LORA_SCHEMA,
        "UnloadLoRAAdapterRequest": UNLOAD_LORA_SCHEMA,
        "MessagesRequest": MESSAGES_REQUEST.schema(ctx),
        "MessagesCountTokensRequest": COUNT_TOKENS_REQUEST.schema(ctx),
        # Ollama's bodies: its fields as Ollama's API documents them (generate: prompt, system, raw; chat:
        # messages, tools; both: options, format, stream, keep_alive; embed: input, dimensions)
        "OllamaRequest": {
            "type": "object",
            "properties": {
                "model": _STR,
                "prompt": _STR,
                "system": _STR,
                "raw": {"type": "boolean"},
                "stream": {"type": "boolean"},
                "messages": {"type": "array", "items": {"type": "object"}},
                "options": {"type": "object"},
                "input": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
            },
            "required": ["model"],
        },
        "Error": error,
    }


def _op(summary: str, body: str | None = None, ok: str = "application/json", auth: bool = True) -> JSON:
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    op: JSON = {"summary": summary, "responses": {"200": {"description": "OK", "content": {ok: {}}}}}
    if body:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
        }
        op["responses"]["400"] = {"description": "Bad request", "content": err}
        op["responses"]["413"] = {"description": "Body larger than --max-request-bytes", "content": err}
    if auth:
        op["security"] = [{"bearer": []}]
        op["responses"]["401"] = {
            "description": "Missing or wrong API key (when the server has one)",
            "content": err,
        }
    return op


def _generate_op(summary: str, body: str) -> JSON:
    op = _op(summary, body)
    op["responses"]["200"]["content"]["text/event-stream"] = {}
    op["responses"]["404"] = {"description": "Unknown model"}
    op["responses"]["503"] = {"description": "Queue full (Retry-After), shutting down, or engine dead"}
    return op


def _embeddings_op() -> JSON:
    op = _op("Embeddings of strings or token ids (pooled, unit length)", "EmbeddingRequest")
    op["responses"]["404"] = {"description": "Unknown model"}
    op["responses"]["503"] = {"description": "Queue full (Retry-After), shutting down, or engine dead"}
    return op


def _ollama_op(summary: str) -> JSON:
    """Ollama's routes (docs/api.md): their bodies follow Ollama's API; errors are ``{"error": ...}``."""
    op = _op(summary, "OllamaRequest")
    op["responses"]["200"]["content"]["application/x-ndjson"] = {}
    op["responses"]["404"] = {"description": "Unknown model"}
    return op


@cache
def openapi_spec(
    version: str, limits: RequestLimits = DEFAULT_LIMITS, vocab_size: int = 1 << 31, priority: bool = False
) -> JSON:
    """The document; `vocab_size` bounds token ids, `priority` says whether requests may set one."""
    models_op = _op("One served model")
    models_op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": _STR}]
    models_op["responses"]["404"] = {"description": "Unknown model"}
    static_op = _op(
        "The chat page's libraries (marked.umd.js, purify.min.js)", ok="text/javascript", auth=False
    )
    files = {"type": "string", "enum": sorted(STATIC_FILES)}
    static_op["parameters"] = [{"name": "name", "in": "path", "required": True, "schema": files}]
    static_op["responses"]["404"] = {"description": "No such file"}
    ws_op = _op("Websocket: streamed generations, cancellable (docs/websocket.md); a plain GET gets 400")
    ws_op["responses"]["400"] = {"description": "Not a websocket upgrade"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aioengine",
            "version": version,
            "description": "OpenAI-compatible API of aioengine; see docs/api.md and docs/websocket.md.",
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _generate_op("Chat completion (JSON or SSE stream)", "ChatCompletionRequest")
            },
            "/v1/completions": {
                "post": _generate_op("Text completion (JSON or SSE stream)", "CompletionRequest")
            },
            "/v1/responses": {
                "post": _generate_op("Responses API, text only (JSON or SSE events)", "ResponsesRequest")
            },
            "/v1/messages": {
                "post": _generate_op("Anthropic's Messages API (JSON or SSE events)", "MessagesRequest")
            },
            "/v1/messages/count_tokens": {
                "post": _op("The prompt's token count for a Messages body", "MessagesCountTokensRequest")
            },
            "/v1/embeddings": {"post": _embeddings_op()},
            "/v1/models": {"get": _op("List the served model names and LoRA adapters")},
            "/v1/load_lora_adapter": {
                "post": _op(
                    "Serve a LoRA adapter from now on (--enable-lora-runtime-updates)",
                    "LoadLoRAAdapterRequest",
                    ok="text/plain",
                )
            },
            "/v1/unload_lora_adapter": {
                "post": _op(
                    "Stop serving a LoRA adapter (--enable-lora-runtime-updates)",
                    "UnloadLoRAAdapterRequest",
                    ok="text/plain",
                )
            },
            "/v1/models/{model}": {"get": models_op},
            "/v1/ws": {"get": ws_op},
            "/tokenize": {"post": _op("Token ids of a prompt or a chat conversation", "TokenizeRequest")},
            "/detokenize": {"post": _op("Text of token ids", "DetokenizeRequest")},
            "/health": {"get": _op("200 while the engine is alive, 503 when it is dead", auth=False)},
            "/version": {"get": _op("Server version", auth=False)},
            "/metrics": {"get": _op("Prometheus metrics", ok="text/plain", auth=False)},
            "/openapi.json": {"get": _op("This document", auth=False)},
            "/": {"get": _op("The chat page", ok="text/html", auth=False)},
            "/static/{name}": {"get": static_op},
            "/api/generate": {"post": _ollama_op("Ollama's generate (JSON or NDJSON stream)")},
            "/api/chat": {"post": _ollama_op("Ollama's chat (JSON or NDJSON stream)")},
            "/api/embed": {"post": _ollama_op("Ollama's embeddings (unit vectors)")},
            "/api/show": {"post": _ollama_op("Ollama's model details")},
            "/api/tags": {"get": _op("Ollama's list of models")},
            "/api/ps": {"get": _op("Ollama's list of loaded models")},
            "/api/version": {"get": _op("Ollama's version route")},
        },
        "components": {
            "schemas": _schemas(limits, vocab_size, priority),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
