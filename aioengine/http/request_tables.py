"""Every field a request body may carry, in one table per body: the parsers (protocol.py,
openai_responses.py) read them through these specs (unknown fields are refused, types, bounds and choices
checked), and /openapi.json (openapi.py) states them from the same specs.

A field that is more than a typed scalar (messages, tools, tool_choice, response_format, input, prompt,
stop, the token-id lists, logit_bias, metadata, chat_template_kwargs...) is a shape (shapes.py): the same
declaration checks it and gives its schema here.
"""

from __future__ import annotations

from typing import Any

from aioengine.http.messages import MESSAGES, TEMPLATE_KWARGS
from aioengine.http.schema import JSON, Spec, Table, object_schema
from aioengine.http.shapes import Array, Either, ListOf, Map, Obj, Shape, Tagged, TokenId, Value
from aioengine.http.tools import TOOL_CHOICE, TOOLS
from aioengine.sampling_params import BOUNDS

REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_METADATA = 16

_STR: JSON = {"type": "string"}
_TEXT_VALUE = Value(str)


# ---- shapes the parsers read themselves: shapes.py checks them and states their schema --------------------
STOP = Either(
    (
        Value(str, min_length=1, max_length=lambda limits: limits.max_stop_chars),
        Array(
            Value(str, min_length=1, max_length=lambda limits: limits.max_stop_chars),
            max_items=lambda limits: limits.max_stop,
            what="strings",
        ),
    ),
    "a string or an array of strings",
)
BAD_WORDS = Either(
    (Value(str), Array(Value(str), max_items=lambda limits: limits.max_bad_words, what="words")),
    "a string or an array of strings",
)


_JSON_SCHEMA_FIELDS: dict[str, Shape] = {
    "name": _TEXT_VALUE,
    "description": _TEXT_VALUE,
    "strict": Value(bool),
    "schema": Value(dict, description="a JSON schema"),
}
RESPONSE_FORMAT = Tagged(
    "type",
    {
        "text": Obj({"type": _TEXT_VALUE}),
        "json_object": Obj({"type": _TEXT_VALUE}),
        "json_schema": Obj(
            {"type": _TEXT_VALUE, "json_schema": Obj(_JSON_SCHEMA_FIELDS, ("schema",))}, ("json_schema",)
        ),
    },
)


_PROMPTS = Array(Value(str, min_length=1), 1, lambda limits: limits.max_prompts, "prompts")
_TOKEN_LIST = Array(TokenId(), 1, what="token ids")
PROMPT = Either(
    (
        Value(str, min_length=1),
        ListOf(
            (_PROMPTS, _TOKEN_LIST, Array(_TOKEN_LIST, 1, lambda limits: limits.max_prompts, "prompts")),
            "an array of strings, of token ids, or of arrays of token ids",
        ),
    ),
    "a string, an array of strings, an array of token ids, or an array of arrays of token ids",
    description="at most max_prompts completions (prompts x n) in one request (--request-limit)",
)
STOP_TOKEN_IDS = Array(TokenId(), max_items=lambda limits: limits.max_token_ids, what="token ids")
ALLOWED_TOKEN_IDS = Array(TokenId(), 1, lambda limits: limits.max_token_ids, "token ids")
TOKENS = Array(TokenId(), what="token ids")
LOGIT_BIAS = Map(
    Value(float),
    key_pattern=("[0-9]{1,9}", "token ids"),
    max_entries=lambda limits: limits.max_logit_bias,
    description="token id -> bias, clamped to [-100, 100]",
)
METADATA = Map(Value(str), max_entries=MAX_METADATA)


def _sampled(kind: type, name: str, later: bool = True, **extra: Any) -> Spec:
    """A field whose bounds are sampling_params.BOUNDS[name], the one statement of them. ``later``: Fields
    leaves the check to SamplingParams (vLLM's messages); otherwise Fields checks them first."""
    r = BOUNDS[name]
    return Spec(kind, lo=r.lo, hi=r.hi, exclusive_lo=r.exclusive_lo, checked_later=later, **extra)


def _metadata() -> Spec:
    return Spec(None, schema=METADATA.schema)


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
    "stop": Spec(None, schema=STOP.schema),
    "stop_token_ids": Spec(None, schema=STOP_TOKEN_IDS.schema),
    "ignore_eos": Spec(bool),
    "include_stop_str_in_output": Spec(bool),
    "skip_special_tokens": Spec(bool),
    "speculative": Spec(bool, description="false: never verify drafts, when the server speculates"),
    "timeout_s": _sampled(float, "timeout_s", description='seconds; then finish_reason "timeout"'),
    "prompt_logprobs": _sampled(int, "prompt_logprobs", later=False, description="vLLM's: per prompt token"),
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
    "logit_bias": Spec(None, schema=LOGIT_BIAS.schema),
    "allowed_token_ids": Spec(None, schema=ALLOWED_TOKEN_IDS.schema),
    "bad_words": Spec(None, schema=BAD_WORDS.schema),
    "response_format": Spec(None, schema=RESPONSE_FORMAT.schema),
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
    "messages": Spec(None, schema=MESSAGES.schema),
    "max_tokens": _sampled(int, "max_tokens", description=_MAX_TOKENS),
    "max_completion_tokens": _sampled(int, "max_tokens", description=_MAX_TOKENS),
    "logprobs": Spec(bool),
    "top_logprobs": _sampled(int, "logprobs", later=False, description="needs logprobs: true"),
    "chat_template_kwargs": Spec(None, schema=TEMPLATE_KWARGS.schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool, description="the last message must be the assistant's"),
    "tools": Spec(None, schema=TOOLS.schema),
    "tool_choice": Spec(None, schema=TOOL_CHOICE.schema),
    "parallel_tool_calls": Spec(bool),
    "store": Spec(None, schema={"const": False}),  # nothing is stored: true is refused
    "metadata": _metadata(),
    "reasoning_effort": Spec(str, enum=REASONING_EFFORTS),
    "thinking_token_budget": _sampled(
        int, "thinking_token_budget", description="tokens in the think block; then </think> is forced"
    ),
    "service_tier": Spec(str, enum=("auto", "default"), checked_later=True),  # others: "not supported"
}
CHAT_REQUIRED = ("messages",)

COMPLETION: Table = {
    **SAMPLING,
    "prompt": Spec(None, schema=PROMPT.schema),
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
    "messages": Spec(None, schema=MESSAGES.schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool),
    "chat_template_kwargs": Spec(None, schema=TEMPLATE_KWARGS.schema),
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

DETOKENIZE: Table = {"model": Spec(str), "tokens": Spec(None, schema=TOKENS.schema)}

# ---- /v1/embeddings ---------------------------------------------------------------------------------------
EMBEDDING: Table = {
    "model": Spec(str),
    "input": Spec(None, schema=lambda ctx: {**PROMPT.schema(ctx), "description": "at most max_prompts"}),
    "encoding_format": Spec(str, enum=("float", "base64")),
    "dimensions": Spec(int, lo=1, description="cut the unit vector to its first dimensions, renormalized"),
    "user": SAMPLING["user"],
    "request_id": SAMPLING["request_id"],
    "priority": SAMPLING["priority"],
}
EMBEDDING_REQUIRED = ("input",)

# ---- /v1/responses ---------------------------------------------------------------------------------------
# Parts echoed back from an earlier output carry annotations and logprobs: any other keys are fine.
_INPUT_PART = Obj({"type": _TEXT_VALUE, "text": _TEXT_VALUE}, ("text",), open=True)
# The Responses API's function tool (flat: name and parameters beside the type).
RESPONSE_TOOL = Obj(
    {
        "type": Value(str, enum=("function",)),
        "name": _TEXT_VALUE,
        "description": _TEXT_VALUE,
        "parameters": Value(dict),
        "strict": Value(bool),
    },
    ("type", "name"),
)
_CALL_ITEM = Obj(
    {
        "type": _TEXT_VALUE,
        "call_id": _TEXT_VALUE,
        "name": _TEXT_VALUE,
        "arguments": _TEXT_VALUE,
        "id": _TEXT_VALUE,
        "status": _TEXT_VALUE,
    },
    ("call_id", "name", "arguments"),
)
_CALL_OUTPUT_ITEM = Obj(
    {
        "type": _TEXT_VALUE,
        "call_id": _TEXT_VALUE,
        "output": _TEXT_VALUE,
        "id": _TEXT_VALUE,
        "status": _TEXT_VALUE,
    },
    ("call_id", "output"),
)
INPUT = Either(
    (
        _TEXT_VALUE,
        Array(
            Tagged(
                "type",
                {
                    "message": Obj(
                        {
                            "type": _TEXT_VALUE,
                            "role": Value(str, enum=("user", "assistant", "system", "developer")),
                            "content": Either(
                                (
                                    _TEXT_VALUE,
                                    Array(
                                        Tagged(
                                            "type",
                                            {k: _INPUT_PART for k in ("input_text", "output_text", "text")},
                                            "Content parts of type {}",
                                        )
                                    ),
                                ),
                                "a string or an array of content parts",
                            ),
                            "id": _TEXT_VALUE,
                            "status": _TEXT_VALUE,
                        },
                        ("role", "content"),
                    ),
                    "function_call": _CALL_ITEM,
                    "function_call_output": _CALL_OUTPUT_ITEM,
                },
                "Input items of type {}",
                default="message",
            ),
            min_items=1,
            max_items=lambda limits: limits.max_messages,
            what="items",
        ),
    ),
    "a string or a non-empty array of message items",
)
TEXT_FORMAT = Tagged(
    "type",
    {
        "text": Obj({"type": _TEXT_VALUE}),
        "json_object": Obj({"type": _TEXT_VALUE}),
        "json_schema": Obj({"type": _TEXT_VALUE, **_JSON_SCHEMA_FIELDS}, ("schema",)),
    },
)
RESPONSE_TEXT: Table = {"format": Spec(None, schema=TEXT_FORMAT.schema), "verbosity": Spec(str)}
RESPONSE_REASONING: Table = {
    "effort": Spec(str, enum=REASONING_EFFORTS, checked_later=True),  # as the chat request's reasoning_effort
    "summary": Spec(None),
    "generate_summary": Spec(None),
}
RESPONSE: Table = {  # openai_responses.to_chat_body turns it into a CHAT body
    "model": Spec(str),
    "input": Spec(None, schema=INPUT.schema),
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
        list, schema=lambda ctx: {"items": RESPONSE_TOOL.schema(ctx), "description": "function tools"}
    ),
    "tool_choice": Spec(
        None,
        schema={
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {"type": "object", "properties": {"type": {"const": "function"}, "name": _STR}},
            ]
        },
    ),
    "parallel_tool_calls": Spec(bool),
    "truncation": Spec(str, enum=("disabled", "auto")),
    "include": Spec(list, schema={"maxItems": 0, "description": "not supported"}),
    "previous_response_id": Spec(
        None, schema={"const": False, "description": "not supported: nothing is stored"}
    ),
    "background": Spec(bool, schema={"const": False, "description": "not supported"}),
    "service_tier": CHAT["service_tier"],
    "top_logprobs": Spec(int, schema={"const": 0, "description": "not supported here"}),
    "structured_outputs": SAMPLING["structured_outputs"],  # vLLM's, as on the chat route
    "safety_identifier": Spec(str),
    "prompt_cache_key": Spec(str),
}
RESPONSE_REQUIRED = ("input",)
