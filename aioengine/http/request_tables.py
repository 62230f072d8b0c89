"""The request fields and shapes several routes share: sampling fields (SAMPLING), stop, prompts, token-id
lists, logit_bias, metadata, response_format, structured_outputs, stream_options, and the /tokenize and
/detokenize bodies. Each API family declares its own body from these (openai/chat.py's CHAT, ...): its parser
reads it through the specs (unknown fields refused; types, bounds and choices checked), and /openapi.json
states the same specs. A field that is more than a typed scalar is a shape (shapes.py): the same declaration
checks it and gives its schema.
"""

from __future__ import annotations

from typing import Any

from aioengine.http.messages import MESSAGES, TEMPLATE_KWARGS
from aioengine.http.schema import JSON, Spec, Table, object_schema
from aioengine.http.shapes import Array, Either, ListOf, Map, Obj, Shape, Tagged, TokenId, Value
from aioengine.sampling_params import BOUNDS

REQUEST_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
MAX_METADATA = 16

STR_SCHEMA: JSON = {"type": "string"}
TEXT_VALUE = Value(str)


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


JSON_SCHEMA_FIELDS: dict[str, Shape] = {
    "name": TEXT_VALUE,
    "description": TEXT_VALUE,
    "strict": Value(bool),
    "schema": Value(dict, description="a JSON schema"),
}
RESPONSE_FORMAT = Tagged(
    "type",
    {
        "text": Obj({"type": TEXT_VALUE}),
        "json_object": Obj({"type": TEXT_VALUE}),
        "json_schema": Obj(
            {"type": TEXT_VALUE, "json_schema": Obj(JSON_SCHEMA_FIELDS, ("schema",))}, ("json_schema",)
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


def sampled(kind: type, name: str, later: bool = True, **extra: Any) -> Spec:
    """A field whose bounds are sampling_params.BOUNDS[name], the one statement of them. ``later``: Fields
    leaves the check to SamplingParams (vLLM's messages); otherwise Fields checks them first."""
    r = BOUNDS[name]
    return Spec(kind, lo=r.lo, hi=r.hi, exclusive_lo=r.exclusive_lo, checked_later=later, **extra)


def metadata_spec() -> Spec:
    return Spec(None, schema=METADATA.schema)


# ---- sub-objects -----------------------------------------------------------------------------------------
STREAM_OPTIONS: Table = {"include_usage": Spec(bool), "continuous_usage_stats": Spec(bool)}

# vLLM's structured_outputs object (StructuredOutputsParams checks that exactly one is set)
STRUCTURED_OUTPUTS: Table = {
    "json": Spec(
        None, schema={"anyOf": [{"type": "object"}, STR_SCHEMA], "description": "a JSON schema, or its text"}
    ),
    "regex": Spec(str, schema={"minLength": 1}),
    "choice": Spec(list, schema={"items": STR_SCHEMA, "minItems": 1}),
    "grammar": Spec(str, schema={"minLength": 1}),
    "json_object": Spec(bool),
    "disable_any_whitespace": Spec(bool),
}

# Ollama's keep_alive, taken by every route that names a model: how long the model stays loaded once idle
# (seconds or a duration; 0 unloads after the reply, negative never). A server of several models reads and
# checks it before the route (http/model_pool.py); one model stays loaded for the server's life.
KEEP_ALIVE = Spec(
    None,
    schema={
        "oneOf": [{"type": "string"}, {"type": "number"}],
        "description": "seconds or a duration (30s, 5m, 1h); 0: unload after the reply; -1: never",
    },
)

# ---- /v1/chat/completions and /v1/completions --------------------------------------------------------------
MAX_TOKENS_NOTE = "prompt + max_tokens must fit max_model_len"
SAMPLING: Table = {
    "model": Spec(str),
    "keep_alive": KEEP_ALIVE,
    "n": Spec(
        int, lo=BOUNDS["n"].lo, hi=lambda limits: limits.max_n, description="above 1 needs temperature > 0"
    ),
    "temperature": sampled(float, "temperature", description="0 is greedy"),
    "top_p": sampled(float, "top_p"),
    "top_k": sampled(int, "top_k", description="0 or -1: off"),
    "min_p": sampled(float, "min_p"),
    "seed": sampled(int, "seed"),
    "min_tokens": sampled(int, "min_tokens", description="at most max_tokens"),
    "stop": Spec(None, schema=STOP.schema),
    "stop_token_ids": Spec(None, schema=STOP_TOKEN_IDS.schema),
    "ignore_eos": Spec(bool),
    "include_stop_str_in_output": Spec(bool),
    "skip_special_tokens": Spec(bool),
    "speculative": Spec(bool, description="false: never verify drafts, when the server speculates"),
    "timeout_s": sampled(float, "timeout_s", description='seconds; then finish_reason "timeout"'),
    "prompt_logprobs": sampled(int, "prompt_logprobs", later=False, description="vLLM's: per prompt token"),
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
    "presence_penalty": sampled(float, "presence_penalty"),
    "frequency_penalty": sampled(float, "frequency_penalty"),
    "repetition_penalty": sampled(float, "repetition_penalty"),
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


# ---- /tokenize and /detokenize -----------------------------------------------------------------------------
TOKENIZE: Table = {
    "model": Spec(str),
    "keep_alive": KEEP_ALIVE,
    "add_special_tokens": Spec(bool),
    "return_token_strs": Spec(bool),
    "prompt": Spec(str),
    "messages": Spec(None, schema=MESSAGES.schema),
    "add_generation_prompt": Spec(bool),
    "continue_final_message": Spec(bool),
    "chat_template_kwargs": Spec(None, schema=TEMPLATE_KWARGS.schema),
}
TOKENIZE_PROMPT = ("model", "keep_alive", "add_special_tokens", "return_token_strs", "prompt")  # one of two
TOKENIZE_MESSAGES = (
    "model",
    "keep_alive",
    "add_special_tokens",
    "return_token_strs",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)

DETOKENIZE: Table = {"model": Spec(str), "keep_alive": KEEP_ALIVE, "tokens": Spec(None, schema=TOKENS.schema)}

# ---- /v1/embeddings ---------------------------------------------------------------------------------------

# ---- /v1/responses ---------------------------------------------------------------------------------------
