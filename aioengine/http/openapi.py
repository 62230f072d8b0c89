"""The OpenAPI 3.1 description of the server's routes, served at /openapi.json."""

from __future__ import annotations

from functools import cache

_NUM, _INT, _BOOL, _STR = {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "string"}
_STRS = {"oneOf": [_STR, {"type": "array", "items": _STR}]}
_INTS = {"type": "array", "items": _INT}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_SAMPLING = {
    "model": _nullable(_STR), "n": {**_INT, "minimum": 1, "maximum": 128, "default": 1},
    "temperature": {**_NUM, "minimum": 0, "default": 1.0}, "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {**_INT, "description": "0 or -1 disables"}, "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "seed": _nullable(_INT), "min_tokens": {**_INT, "minimum": 0}, "stop": _nullable(_STRS),
    "stop_token_ids": _INTS, "ignore_eos": _BOOL, "include_stop_str_in_output": _BOOL,
    "skip_special_tokens": _BOOL, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL,
                                                        "continuous_usage_stats": _BOOL}},
    "user": _STR, "request_id": _STR, "priority": {**_INT, "description": "with --scheduling-policy priority"},
    "presence_penalty": {**_NUM, "minimum": -2, "maximum": 2}, "frequency_penalty": {**_NUM, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUM, "exclusiveMinimum": 0},
    "logit_bias": {"type": "object", "additionalProperties": _NUM, "description": "token id -> bias in [-100, 100]"},
    "allowed_token_ids": _INTS, "bad_words": _STRS,
    "response_format": {"type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                                                         "json_schema": {"type": "object"}}},
    "structured_outputs": {"type": "object", "description": "one of json, regex, choice, grammar, json_object",
                           "properties": {"json": {}, "regex": _STR, "choice": {"type": "array", "items": _STR},
                                          "grammar": _STR, "json_object": _BOOL, "disable_any_whitespace": _BOOL}},
}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [_STR, {"type": "array", "items": {"type": "object", "properties": {
        "type": {"const": "text"}, "text": _STR}}}]}, "name": _STR}}
_CHAT = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING, "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "max_tokens": _nullable({**_INT, "minimum": 1}), "max_completion_tokens": _nullable({**_INT, "minimum": 1}),
    "logprobs": _BOOL, "top_logprobs": {**_INT, "minimum": 0, "maximum": 20},
    "chat_template_kwargs": {"type": "object"}, "add_generation_prompt": _BOOL, "continue_final_message": _BOOL,
    "tools": {"type": "array", "maxItems": 0}, "tool_choice": {"enum": ["none", "auto"]},
    "parallel_tool_calls": _BOOL, "store": {"const": False}, "metadata": {"type": "object"},
    "service_tier": {"enum": ["auto", "default"]}}}
_COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING, "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR}, _INTS,
                                      {"type": "array", "items": _INTS}]},
    "max_tokens": {**_INT, "minimum": 1, "default": 16}, "echo": _BOOL,
    "best_of": {**_INT, "description": "only equal to n"}, "suffix": {"type": "null"},
    "logprobs": {**_INT, "minimum": 0, "maximum": 20, "description": "not with echo"}}}
_TOKENIZE = {"type": "object", "properties": {
    "model": _STR, "prompt": _STR, "messages": {"type": "array", "items": _MESSAGE}, "add_special_tokens": _BOOL,
    "add_generation_prompt": _BOOL, "continue_final_message": _BOOL, "return_token_strs": _BOOL,
    "chat_template_kwargs": {"type": "object"}}}
_DETOKENIZE = {"type": "object", "required": ["tokens"], "properties": {"model": _STR, "tokens": _INTS}}
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": _STR, "type": _STR, "param": _nullable(_STR), "code": {"oneOf": [_STR, _INT]}}}}}


def _op(summary: str, body: str | None = None, ok: str = "application/json", auth: bool = True) -> dict:
    op: dict = {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {ok: {}}},
        "400": {"description": "Bad request", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
    }}
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}
    if auth:
        op["security"] = [{"bearer": []}]
        op["responses"]["401"] = {"description": "Missing or wrong API key (when the server has one)"}
    return op


def _generate_op(summary: str, body: str) -> dict:
    op = _op(summary, body)
    op["responses"]["200"]["content"]["text/event-stream"] = {}
    op["responses"]["404"] = {"description": "Unknown model"}
    op["responses"]["413"] = {"description": "Body larger than --max-request-bytes"}
    op["responses"]["503"] = {"description": "Queue full (Retry-After), shutting down, or engine dead"}
    return op


@cache
def openapi_spec(version: str) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "aioengine", "version": version,
                 "description": "OpenAI-compatible API of aioengine; see docs/api.md and docs/websocket.md."},
        "paths": {
            "/v1/chat/completions": {"post": _generate_op("Chat completion (JSON or SSE stream)", "ChatCompletionRequest")},
            "/v1/completions": {"post": _generate_op("Text completion (JSON or SSE stream)", "CompletionRequest")},
            "/v1/models": {"get": _op("List the served model names")},
            "/v1/models/{model}": {"get": _op("One served model")},
            "/v1/ws": {"get": _op("Websocket: streamed generations, cancellable (docs/websocket.md)")},
            "/tokenize": {"post": _op("Token ids of a prompt or a chat conversation", "TokenizeRequest")},
            "/detokenize": {"post": _op("Text of token ids", "DetokenizeRequest")},
            "/health": {"get": _op("200 while the engine is alive, 503 when it is dead", auth=False)},
            "/version": {"get": _op("Server version", auth=False)},
            "/metrics": {"get": _op("Prometheus metrics", ok="text/plain", auth=False)},
            "/openapi.json": {"get": _op("This document", auth=False)},
            "/": {"get": _op("The chat page", ok="text/html", auth=False)},
        },
        "components": {
            "schemas": {"ChatCompletionRequest": _CHAT, "CompletionRequest": _COMPLETION,
                        "TokenizeRequest": _TOKENIZE, "DetokenizeRequest": _DETOKENIZE, "Error": _ERROR},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
