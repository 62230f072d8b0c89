"""The OpenAPI 3.1 description of the server's routes, served at /openapi.json.

The request schemas say what aioengine/http/protocol.py accepts: unknown fields are refused, null means the
default, and the per-request caps are the server's RequestLimits. What a schema cannot say (`n > 1` needs
a temperature above 0, `stream_options` needs `stream`, a grammar must compile) is in the descriptions.
"""

from __future__ import annotations

from functools import cache

from aioengine.http.protocol import DEFAULT_LIMITS, RESERVED_TEMPLATE_KWARGS, RequestLimits
from aioengine.sampling_params import MAX_LOGPROBS

_NUM, _INT, _BOOL, _STR = {"type": "number"}, {"type": "integer"}, {"type": "boolean"}, {"type": "string"}


def _opt(schema: dict) -> dict:
    """Null means the default, for every field."""
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(properties: dict, required: tuple[str, ...] = (), **extra: object) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False,
            **extra}


def _schemas(limits: RequestLimits, vocab_size: int, priority: bool) -> dict:
    token = {**_INT, "minimum": 0, "maximum": max(vocab_size - 1, 0)}
    tokens = {"type": "array", "items": token}
    text = {**_STR, "minLength": 1}
    logprobs_k = {**_INT, "minimum": 0, "maximum": MAX_LOGPROBS}
    template_kwargs = {"type": "object", "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
                       "description": "extra variables for the chat template"}
    sampling = {
        "model": _opt(_STR),
        "n": _opt({**_INT, "minimum": 1, "maximum": limits.max_n, "description": "above 1 needs temperature > 0"}),
        "temperature": _opt({**_NUM, "minimum": 0, "description": "0 is greedy"}),
        "top_p": _opt({**_NUM, "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _opt({**_INT, "minimum": -1, "description": "0 or -1: off"}),
        "min_p": _opt({**_NUM, "minimum": 0, "maximum": 1}),
        "seed": _opt({**_INT, "minimum": -(2**63), "maximum": 2**63 - 1}),
        "min_tokens": _opt({**_INT, "minimum": 0, "description": "at most max_tokens"}),
        "stop": _opt({"anyOf": [{**text, "maxLength": limits.max_stop_chars}, {
            "type": "array", "maxItems": limits.max_stop, "items": {**text, "maxLength": limits.max_stop_chars}}]}),
        "stop_token_ids": _opt({**tokens, "maxItems": limits.max_token_ids}),
        "ignore_eos": _opt(_BOOL), "include_stop_str_in_output": _opt(_BOOL), "skip_special_tokens": _opt(_BOOL),
        "stream": _opt(_BOOL),
        "stream_options": _opt({**_obj({"include_usage": _opt(_BOOL), "continuous_usage_stats": _opt(_BOOL)}),
                                "description": "only with stream: true"}),
        "user": _opt(_STR),
        "request_id": _opt({**_STR, "pattern": "^[A-Za-z0-9._:-]{1,128}$"}),
        "priority": _opt({**_INT, "description": "lower runs first"} if priority else
                         {"const": 0, "description": "only 0 unless --scheduling-policy priority"}),
        "presence_penalty": _opt({**_NUM, "minimum": -2, "maximum": 2}),
        "frequency_penalty": _opt({**_NUM, "minimum": -2, "maximum": 2}),
        "repetition_penalty": _opt({**_NUM, "exclusiveMinimum": 0}),
        "logit_bias": _opt({"type": "object", "maxProperties": limits.max_logit_bias,
                            "propertyNames": {"pattern": "^[0-9]{1,9}$"}, "additionalProperties": _NUM,
                            "description": "token id -> bias, clamped to [-100, 100]"}),
        "allowed_token_ids": _opt({**tokens, "minItems": 1, "maxItems": limits.max_token_ids}),
        "bad_words": _opt({"anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": limits.max_bad_words}]}),
        "response_format": _opt({"oneOf": [
            _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["schema"], "properties": {
                    "name": _STR, "schema": {"type": "object", "description": "a JSON schema"}}}}},
        ]}),
        "structured_outputs": _opt({**_obj({
            "json": {"anyOf": [{"type": "object"}, _STR], "description": "a JSON schema, or its text"},
            "regex": text, "choice": {"type": "array", "items": _STR, "minItems": 1}, "grammar": text,
            "json_object": _BOOL, "disable_any_whitespace": _BOOL}),
            "description": "exactly one of json, regex, choice, grammar, json_object; not with response_format"}),
    }
    content_part = _obj({"type": {"const": "text"}, "text": _STR}, ("type", "text"))
    content = {"anyOf": [_STR, {"type": "array", "items": content_part}]}
    tool_call = _obj({"id": _STR, "type": {"const": "function"},
                      "function": _obj({"name": _STR, "arguments": _STR}, ("name", "arguments"))}, ("function",))
    message = {"oneOf": [
        _obj({"role": {"enum": ["system", "developer", "user"]}, "content": content, "name": _opt(_STR)},
             ("role", "content")),
        _obj({"role": {"const": "assistant"}, "content": _opt(content), "name": _opt(_STR), "refusal": _opt(_STR),
              "tool_calls": _opt({"type": "array", "items": tool_call})}, ("role",)),
        _obj({"role": {"const": "tool"}, "content": content, "tool_call_id": _STR}, ("role", "content", "tool_call_id")),
    ]}
    name = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}
    tool = _obj({"type": {"const": "function"}, "function": _obj({
        "name": name, "description": _opt(_STR), "strict": _opt(_BOOL),
        "parameters": _opt({"type": "object", "description": "a JSON schema (forced calls are constrained to it)"}),
    }, ("name",))}, ("type", "function"))
    tool_choice = {"anyOf": [{"enum": ["none", "auto", "required"]},
                             _obj({"type": {"const": "function"}, "function": _obj({"name": name}, ("name",))},
                                  ("type", "function"))],
                   "description": "needs tools; a named function must be one of them (docs/api.md, Tool calling)"}
    messages = {"type": "array", "items": message, "minItems": 1, "maxItems": limits.max_messages}
    max_tokens = _opt({**_INT, "minimum": 1, "description": "prompt + max_tokens must fit max_model_len"})
    chat = _obj({
        **sampling, "messages": messages, "max_tokens": max_tokens, "max_completion_tokens": max_tokens,
        "logprobs": _opt(_BOOL), "top_logprobs": _opt({**logprobs_k, "description": "needs logprobs: true"}),
        "chat_template_kwargs": _opt(template_kwargs), "add_generation_prompt": _opt(_BOOL),
        "continue_final_message": _opt({**_BOOL, "description": "the last message must be the assistant's"}),
        "tools": _opt({"type": "array", "items": tool, "maxItems": 128}), "tool_choice": _opt(tool_choice),
        "parallel_tool_calls": _opt(_BOOL), "store": _opt({"const": False}),
        "metadata": _opt({"type": "object", "maxProperties": 16, "additionalProperties": _STR}),
        "reasoning_effort": _opt({"enum": ["none", "minimal", "low", "medium", "high"]}),
        "service_tier": _opt({"enum": ["auto", "default"]}),
    }, ("messages",))
    prompt = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": limits.max_prompts},
                        {**tokens, "minItems": 1},
                        {"type": "array", "items": {**tokens, "minItems": 1}, "minItems": 1,
                         "maxItems": limits.max_prompts}],
              "description": f"at most {limits.max_prompts} completions (prompts x n) in one request"}
    completion = _obj({
        **sampling, "prompt": prompt, "max_tokens": _opt({**max_tokens["anyOf"][0], "default": 16}),
        "echo": _opt(_BOOL), "best_of": _opt({**_INT, "minimum": 1, "description": "only equal to n"}),
        "suffix": _opt({**_STR, "maxLength": 0}),
        "logprobs": _opt({**logprobs_k, "description": "with echo, the prompt tokens get logprobs too"}),
    }, ("prompt",))
    tokenize_fields = {"model": _opt(_STR), "add_special_tokens": _opt(_BOOL), "return_token_strs": _opt(_BOOL)}
    tokenize = {"oneOf": [
        _obj({**tokenize_fields, "prompt": _STR}, ("prompt",)),
        _obj({**tokenize_fields, "messages": messages, "add_generation_prompt": _opt(_BOOL),
              "continue_final_message": _opt(_BOOL), "chat_template_kwargs": _opt(template_kwargs)}, ("messages",)),
    ]}
    detokenize = _obj({"model": _opt(_STR), "tokens": tokens}, ("tokens",))
    error = {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": _opt(_STR), "code": {"anyOf": [_STR, _INT]}}}}}
    text_part = _obj({"type": {"enum": ["input_text", "output_text"]}, "text": _STR}, ("type", "text"))
    item = _obj({"type": _opt({"const": "message"}), "role": {"enum": ["user", "assistant", "system", "developer"]},
                 "content": {"anyOf": [_STR, {"type": "array", "items": text_part}]}}, ("role", "content"))
    response = _obj({
        "model": _opt(_STR), "input": {"anyOf": [_STR, {"type": "array", "items": item, "minItems": 1,
                                                         "maxItems": limits.max_messages}]},
        "instructions": _opt(_STR), "max_output_tokens": max_tokens, "temperature": sampling["temperature"],
        "top_p": sampling["top_p"], "stream": _opt(_BOOL), "user": _opt(_STR), "store": _opt(_BOOL),
        "metadata": _opt({"type": "object", "maxProperties": 16, "additionalProperties": _STR}),
        "text": _opt(_obj({"format": _obj({"type": {"enum": ["text", "json_object"]}}, ("type",))})),
        "truncation": _opt({"enum": ["disabled", "auto"]}),
    }, ("input",))
    return {"ResponsesRequest": response, "ChatCompletionRequest": chat, "CompletionRequest": completion,
            "TokenizeRequest": tokenize,
            "DetokenizeRequest": detokenize, "Error": error}


def _op(summary: str, body: str | None = None, ok: str = "application/json", auth: bool = True) -> dict:
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    op: dict = {"summary": summary, "responses": {"200": {"description": "OK", "content": {ok: {}}}}}
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        op["responses"]["400"] = {"description": "Bad request", "content": err}
        op["responses"]["413"] = {"description": "Body larger than --max-request-bytes", "content": err}
    if auth:
        op["security"] = [{"bearer": []}]
        op["responses"]["401"] = {"description": "Missing or wrong API key (when the server has one)", "content": err}
    return op


def _generate_op(summary: str, body: str) -> dict:
    op = _op(summary, body)
    op["responses"]["200"]["content"]["text/event-stream"] = {}
    op["responses"]["404"] = {"description": "Unknown model"}
    op["responses"]["503"] = {"description": "Queue full (Retry-After), shutting down, or engine dead"}
    return op


@cache
def openapi_spec(version: str, limits: RequestLimits = DEFAULT_LIMITS, vocab_size: int = 1 << 31,
                 priority: bool = False) -> dict:
    """The document; `vocab_size` bounds token ids, `priority` says whether requests may set one."""
    models_op = _op("One served model")
    models_op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": _STR}]
    models_op["responses"]["404"] = {"description": "Unknown model"}
    ws_op = _op("Websocket: streamed generations, cancellable (docs/websocket.md); a plain GET gets 400")
    ws_op["responses"]["400"] = {"description": "Not a websocket upgrade"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "aioengine", "version": version,
                 "description": "OpenAI-compatible API of aioengine; see docs/api.md and docs/websocket.md."},
        "paths": {
            "/v1/chat/completions": {"post": _generate_op("Chat completion (JSON or SSE stream)", "ChatCompletionRequest")},
            "/v1/completions": {"post": _generate_op("Text completion (JSON or SSE stream)", "CompletionRequest")},
            "/v1/responses": {"post": _generate_op("Responses API, text only (JSON or SSE events)", "ResponsesRequest")},
            "/v1/models": {"get": _op("List the served model names")},
            "/v1/models/{model}": {"get": models_op},
            "/v1/ws": {"get": ws_op},
            "/tokenize": {"post": _op("Token ids of a prompt or a chat conversation", "TokenizeRequest")},
            "/detokenize": {"post": _op("Text of token ids", "DetokenizeRequest")},
            "/health": {"get": _op("200 while the engine is alive, 503 when it is dead", auth=False)},
            "/version": {"get": _op("Server version", auth=False)},
            "/metrics": {"get": _op("Prometheus metrics", ok="text/plain", auth=False)},
            "/openapi.json": {"get": _op("This document", auth=False)},
            "/": {"get": _op("The chat page", ok="text/html", auth=False)},
        },
        "components": {
            "schemas": _schemas(limits, vocab_size, priority),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
