"""Every field a request body may carry, in one table per body: the parsers (protocol.py,
openai_responses.py) read them through these specs (unknown fields are refused, types, bounds and choices
checked), and /openapi.json (openapi.py) states them from the same specs.

A field whose value is more than a typed scalar (stop, messages, tools, prompt, response_format...) is read
by the parser's own code; its entry here holds the JSON schema of that shape.
"""

from __future__ import annotations

from typing import Any

from aioengine.http.fields import JSON, SchemaContext, Spec, Table, object_schema
from aioengine.http.messages import RESERVED_TEMPLATE_KWARGS
from aioengine.http.tools import MAX_TOOLS
from aioengine.sampling_params import BOUNDS

REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_METADATA = 16

_STR: JSON = {"type": "string"}
_NUM: JSON = {"type": "number"}
_TEXT: JSON = {"type": "string", "minLength": 1}


def _opt(schema: JSON) -> JSON:
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(properties: JSON, required: tuple[str, ...] = (), **extra: object) -> JSON:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
        **extra,
    }


# ---- shapes the parsers read themselves ------------------------------------------------------------------
def stop_schema(ctx: SchemaContext) -> JSON:
    one = {**_TEXT, "maxLength": ctx.limits.max_stop_chars}
    return {"anyOf": [one, {"type": "array", "maxItems": ctx.limits.max_stop, "items": one}]}


def template_kwargs_schema(ctx: SchemaContext) -> JSON:
    return {
        "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KWARGS)}},
        "description": "extra variables for the chat template",
    }


def messages_schema(ctx: SchemaContext) -> JSON:
    """messages.py's parse_messages: by role, text content (a string or text parts)."""
    content_part = _obj({"type": {"const": "text"}, "text": _STR}, ("type", "text"))
    content = {"anyOf": [_STR, {"type": "array", "items": content_part}]}
    tool_call = _obj(
        {
            "id": _STR,
            "type": {"const": "function"},
            "function": _obj({"name": _STR, "arguments": _STR}, ("name", "arguments")),
        },
        ("function",),
    )
    message = {
        "oneOf": [
            _obj(
                {"role": {"enum": ["system", "developer", "user"]}, "content": content, "name": _opt(_STR)},
                ("role", "content"),
            ),
            _obj(
                {
                    "role": {"const": "assistant"},
                    "content": _opt(content),
                    "name": _opt(_STR),
                    "refusal": _opt(_STR),
                    "tool_calls": _opt({"type": "array", "items": tool_call}),
                },
                ("role",),
            ),
            _obj(
                {"role": {"const": "tool"}, "content": content, "tool_call_id": _STR},
                ("role", "content", "tool_call_id"),
            ),
        ]
    }
    return {"type": "array", "items": message, "minItems": 1, "maxItems": ctx.limits.max_messages}


_FUNCTION_NAME: JSON = {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"}


def tools_schema(ctx: SchemaContext) -> JSON:
    """tools.py's parse_tools."""
    tool = _obj(
        {
            "type": {"const": "function"},
            "function": _obj(
                {
                    "name": _FUNCTION_NAME,
                    "description": _opt(_STR),
                    "strict": _opt({"type": "boolean"}),
                    "parameters": _opt(
                        {
                            "type": "object",
                            "description": "a JSON schema (forced calls are constrained to it)",
                        }
                    ),
                },
                ("name",),
            ),
        },
        ("type", "function"),
    )
    return {"items": tool, "maxItems": MAX_TOOLS}


TOOL_CHOICE_SCHEMA: JSON = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        _obj(
            {"type": {"const": "function"}, "function": _obj({"name": _FUNCTION_NAME}, ("name",))},
            ("type", "function"),
        ),
    ],
    "description": "needs tools; a named function must be one of them (docs/api.md, Tool calling)",
}

RESPONSE_FORMAT_SCHEMA: JSON = {
    "oneOf": [
        _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": _STR,
                        "schema": {"type": "object", "description": "a JSON schema"},
                    },
                },
            },
        },
    ]
}


def prompt_schema(ctx: SchemaContext) -> JSON:
    """protocol.py's parse_prompt: str | [str] | [int] | [[int]]."""
    tokens = {"type": "array", "items": ctx.token(), "minItems": 1}
    n = ctx.limits.max_prompts
    return {
        "anyOf": [
            _TEXT,
            {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": n},
            tokens,
            {"type": "array", "items": tokens, "minItems": 1, "maxItems": n},
        ],
        "description": f"at most {n} completions (prompts x n) in one request",
    }


def _tokens(ctx: SchemaContext) -> JSON:
    return {"items": ctx.token()}


def _sampled(kind: type, name: str, later: bool = True, **extra: Any) -> Spec:
    """A field whose bounds are sampling_params.BOUNDS[name], the one statement of them. ``later``: Fields
    leaves the check to SamplingParams (vLLM's messages); otherwise Fields checks them first."""
    r = BOUNDS[name]
    return Spec(kind, lo=r.lo, hi=r.hi, exclusive_lo=r.exclusive_lo, checked_later=later, **extra)


def _metadata() -> Spec:
    return Spec(dict, schema={"maxProperties": MAX_METADATA, "additionalProperties": _STR})


# ---- sub-objects -----------------------------------------------------------------------------------------
STREAM_OPTIONS: Table = {"include_usage": Spec(bool), "continuous_usage_stats": Spec(bool)}

# vLLM's structured_outputs object (StructuredOutputsParams checks that exactly one is set)
STRUCTURED_OUTPUTS: Table = {
    "json": Spec(
        None, schema={"anyOf": [{"type": "object"}, _STR], "description": "a JSON schema, or its text"}
    ),
    "regex": Spec(str, schema={"minLength": 1}),
    "choice": Spec(list, schema={"items": _STR, "minItems": 1}),
    "grammar": Spec(str, schema={"minLength": 1}),
    "json_object": Spec(bool),
    "disable_any_whitespace": Spec(bool),
}

# ---- /v1/chat/completions and /v1/completions --------------------------------------------------------------
_MAX_TOKENS = "prompt + max_tokens must fit max_model_len"
SAMPLING: Table = {
    "model": Spec(str),
    "n": Spec(
        int, lo=BOUNDS["n"].lo, hi=lambda limits: limits.max_n, description="above 1 needs temperature > 0"
    ),
    "temperature": _sampled(float, "temperature", description="0 is greedy"),
    "top_p": _sampled(float, "top_p"),
    "top_k": _sampled(int, "top_k", description="0 or -1: off"),
    "min_p": _sampled(float, "min_p"),
    "seed": _sampled(int, "seed"),
    "min_tokens": _sampled(int, "min_tokens", description="at most max_tokens"),
    "stop": Spec(None, schema=stop_schema),
    "stop_token_ids": Spec(
        list, schema=lambda ctx: {"items": ctx.token(), "maxItems": ctx.limits.max_token_ids}
    ),
    "ignore_eos": Spec(bool),
    "include_stop_str_in_output": Spec(bool),
    "skip_special_tokens": Spec(bool),
    "stream": Spec(bool),
    "stream_options": Spec(
        dict,
        schema=lambda ctx: {**object_schema(STREAM_OPTIONS, ctx), "description": "only with stream: true"},
    ),
    "user": Spec(str),
    "request_id": Spec(str, schema={"pattern": REQUEST_ID_PATTERN}),
    "priority": Spec(
        int,
        schema=lambda ctx: (
            {"description": "lower runs first"}
            if ctx.priority
            else {"const": 0, "description": "only 0 unless --scheduling-policy priority"}
        ),
    ),
    "presence_penalty": _sampled(float, "presence_penalty"),
    "frequency_penalty": _sampled(float, "frequency_penalty"),
    "repetition_penalty": _sampled(float, "repetition_penalty"),
    "logit_bias": Spec(
        dict,
        schema=lambda ctx: {
            "maxProperties": ctx.limits.max_logit_bias,
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": _NUM,
            "description": "token id -> bias, clamped to [-100, 100]",
        },
    ),
    "allowed_token_ids": Spec(
        list, schema=lambda ctx: {"items": ctx.token(), "minItems": 1, "maxItems": ctx.limits.max_token_ids}
    ),
    "bad_words": Spec(
        None,
        schema=lambda ctx: {
            "anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": ctx.limits.max_bad_words}]
        },
    ),
    "response_format": Spec(None, schema=RESPONSE_FORMAT_SCHEMA),
    "structured_outputs": Spec(
        dict,
        schema=lambda ctx: {
            **object_schema(STRUCTURED_OUTPUTS, ctx, nullable=False),
            "description": "exactly one of json, regex, choice, grammar, json_object; "
            "not with response_format",
        },
    ),
}

CHAT: Table = {
    **SAMPLING,
    "messages": Spec(None, schema=messages_schema),
    "max_tokens": _sampled(int, "max_tokens", description=_MAX_TOKENS),
    "max_completion_tokens": _sampled(int, "max_tokens", description=_MAX_TOKENS),
    "logprobs": Spec(bool),
    "top_logprobs": _sampled(int, "logprobs", later=False, description="needs logprobs: true"),
    "chat_template_kwargs": Spec(dict, schema=template_kwargs_schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool, description="the last message must be the assistant's"),
    "tools": Spec(list, schema=tools_schema),
    "tool_choice": Spec(None, schema=TOOL_CHOICE_SCHEMA),
    "parallel_tool_calls": Spec(bool),
    "store": Spec(None, schema={"const": False}),  # nothing is stored: true is refused
    "metadata": _metadata(),
    "reasoning_effort": Spec(str, enum=REASONING_EFFORTS),
    "service_tier": Spec(str, enum=("auto", "default"), checked_later=True),  # others: "not supported"
}
CHAT_REQUIRED = ("messages",)

COMPLETION: Table = {
    **SAMPLING,
    "prompt": Spec(None, schema=prompt_schema),
    "max_tokens": _sampled(
        int, "max_tokens", schema={"default": COMPLETION_MAX_TOKENS}, description=_MAX_TOKENS
    ),
    "echo": Spec(bool),
    "best_of": Spec(int, lo=1, description="only equal to n"),
    "suffix": Spec(str, schema={"maxLength": 0}),  # not supported: only empty
    "logprobs": _sampled(
        int, "logprobs", later=False, description="with echo, the prompt tokens get logprobs too"
    ),
}
COMPLETION_REQUIRED = ("prompt",)

# ---- /tokenize and /detokenize -----------------------------------------------------------------------------
TOKENIZE: Table = {
    "model": Spec(str),
    "add_special_tokens": Spec(bool),
    "return_token_strs": Spec(bool),
    "prompt": Spec(str),
    "messages": Spec(None, schema=messages_schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool),
    "chat_template_kwargs": Spec(dict, schema=template_kwargs_schema),
}
TOKENIZE_PROMPT = ("model", "add_special_tokens", "return_token_strs", "prompt")  # exactly one of these two
TOKENIZE_MESSAGES = (
    "model",
    "add_special_tokens",
    "return_token_strs",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)

DETOKENIZE: Table = {"model": Spec(str), "tokens": Spec(list, schema=_tokens)}

# ---- /v1/responses ---------------------------------------------------------------------------------------
_TEXT_PART = _obj({"type": {"enum": ["input_text", "output_text"]}, "text": _STR}, ("type", "text"))


def _input_schema(ctx: SchemaContext) -> JSON:
    item = _obj(
        {
            "type": _opt({"const": "message"}),
            "role": {"enum": ["user", "assistant", "system", "developer"]},
            "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART}]},
        },
        ("role", "content"),
    )
    return {
        "anyOf": [_STR, {"type": "array", "items": item, "minItems": 1, "maxItems": ctx.limits.max_messages}]
    }


RESPONSE_TEXT: Table = {
    "format": Spec(
        None,
        schema={
            **_obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
            "description": "json_schema ({type, name, schema}) is accepted too",
        },
    ),
    "verbosity": Spec(str),
}
RESPONSE_REASONING: Table = {
    "effort": Spec(str, enum=REASONING_EFFORTS, checked_later=True),  # as the chat request's reasoning_effort
    "summary": Spec(None),
    "generate_summary": Spec(None),
}
RESPONSE: Table = {  # openai_responses.to_chat_body turns it into a CHAT body
    "model": Spec(str),
    "input": Spec(None, schema=_input_schema),
    "instructions": Spec(str),
    "max_output_tokens": _sampled(int, "max_tokens", description=_MAX_TOKENS),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "stream": Spec(bool),
    "text": Spec(dict, schema=lambda ctx: object_schema(RESPONSE_TEXT, ctx)),
    "reasoning": Spec(dict, schema=lambda ctx: object_schema(RESPONSE_REASONING, ctx)),
    "user": Spec(str),
    "metadata": _metadata(),
    "store": Spec(bool, description="accepted; nothing is stored"),
    "tools": Spec(
        list, schema={"maxItems": 0, "description": "not supported here: use /v1/chat/completions"}
    ),
    "tool_choice": Spec(None, schema={"enum": ["none", "auto"]}),
    "parallel_tool_calls": Spec(bool),
    "truncation": Spec(str, enum=("disabled", "auto")),
    "include": Spec(list, schema={"maxItems": 0, "description": "not supported"}),
    "previous_response_id": Spec(
        None, schema={"const": False, "description": "not supported: nothing is stored"}
    ),
    "background": Spec(bool, schema={"const": False, "description": "not supported"}),
    "service_tier": CHAT["service_tier"],
    "top_logprobs": Spec(int, schema={"const": 0, "description": "not supported here"}),
    "safety_identifier": Spec(str),
    "prompt_cache_key": Spec(str),
}
RESPONSE_REQUIRED = ("input",)
