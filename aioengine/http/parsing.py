"""Request parsing the generation routes share: the typed requests, the sampling fields -> SamplingParams,
prompts; and the /tokenize and /detokenize bodies. Each family's own parser (openai/chat.py's
parse_chat_request, openai/completions.py's parse_completion_request) builds on these.

Every field a client may send is either used, validated and rejected when it asks for something the engine
cannot do yet, or refused as unknown: nothing is ignored silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aioengine.errors import InvalidRequestError
from aioengine.http.errors import api_error, bad
from aioengine.http.messages import parse_messages, template_kwargs
from aioengine.http.request_tables import (
    ALLOWED_TOKEN_IDS,
    BAD_WORDS,
    DETOKENIZE,
    LOGIT_BIAS,
    PROMPT,
    RESPONSE_FORMAT,
    STOP,
    STOP_TOKEN_IDS,
    STREAM_OPTIONS,
    STRUCTURED_OUTPUTS,
    TOKENIZE,
    TOKENS,
)
from aioengine.http.schema import (
    DEFAULT_LIMITS,
    JSON,
    Fields,
    RequestLimits,
    SchemaContext,
    _ints,
)
from aioengine.http.shapes import Shape
from aioengine.http.tools import ToolSpec
from aioengine.sampling_params import SamplingParams, StructuredOutputsParams

# Re-exported: the routes import the wire basics from here.
__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "GenerationRequest",
    "parse_detokenize_request",
    "parse_prompt",
    "parse_tokenize_request",
]


# ---- requests -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class GenerationRequest:
    """What chat and completion requests share once parsed."""

    model: str | None
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False
    request_id: str | None = None
    priority: int = 0
    user: str | None = None
    want_prompt_logprobs: bool = False  # the request set vLLM's prompt_logprobs (echo's are its own)


@dataclass(slots=True)
class ChatRequest(GenerationRequest):
    messages: list[JSON] = field(default_factory=list)
    chat_template_kwargs: JSON = field(default_factory=dict)
    prompt_ids: list[int] | None = None  # the templated conversation, when tokenized off the loop
    tools: ToolSpec | None = None  # tools and tool_choice (aioengine/http/tools.py)


@dataclass(slots=True)
class CompletionRequest(GenerationRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # long prompts tokenized off the loop


R = TypeVar("R", bound=GenerationRequest)


def _structured_outputs(f: Fields) -> StructuredOutputsParams | None:
    """OpenAI's response_format, or vLLM's structured_outputs object (not both)."""
    rf = f.data.get("response_format")
    if rf is not None:
        RESPONSE_FORMAT.check(rf, "response_format", SchemaContext(f.limits))
    structured = f.get("structured_outputs", dict)
    kind = None if rf is None else rf["type"]
    if kind not in (None, "text"):
        if structured is not None:
            raise bad("Use response_format or structured_outputs, not both.", "structured_outputs")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        assert rf is not None
        return StructuredOutputsParams(json=rf["json_schema"]["schema"])
    if structured is None:
        return None
    Fields(structured, STRUCTURED_OUTPUTS, "structured_outputs.")
    try:
        return StructuredOutputsParams(**structured)
    except TypeError as e:
        raise bad(f"Invalid structured_outputs: {e}", "structured_outputs") from None


def _sampling_params(
    f: Fields,
    max_tokens: int | None,
    logprobs: int | None,
    limits: RequestLimits,
    defaults: Mapping[str, float],
) -> SamplingParams:
    """``defaults``: the model's generation-config defaults for fields the request leaves out."""
    stop = f.data.get("stop")
    if stop is not None:
        STOP.check(stop, "stop", SchemaContext(limits))
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    ctx = SchemaContext(limits)
    raw_stop_ids = shaped(f, "stop_token_ids", STOP_TOKEN_IDS, ctx)
    stop_token_ids = (_ints(raw_stop_ids) or []) if raw_stop_ids is not None else []
    bias = shaped(f, "logit_bias", LOGIT_BIAS, ctx)
    bad_words = f.data.get("bad_words")
    if bad_words is not None:
        BAD_WORDS.check(bad_words, "bad_words", SchemaContext(limits))
        bad_words = [bad_words] if isinstance(bad_words, str) else bad_words
    allowed = shaped(f, "allowed_token_ids", ALLOWED_TOKEN_IDS, ctx)
    if allowed is not None:
        allowed = _ints(allowed)
    try:
        return SamplingParams(
            n=f.int("n", 1),
            temperature=f.float("temperature", defaults.get("temperature", 1.0)),
            top_p=f.float("top_p", defaults.get("top_p", 1.0)),
            top_k=_top_k(f, int(defaults.get("top_k", 0))),
            min_p=f.float("min_p", defaults.get("min_p", 0.0)),
            seed=f.int("seed"),
            max_tokens=max_tokens,
            min_tokens=f.int("min_tokens", 0),
            stop=stop,
            stop_token_ids=stop_token_ids,
            ignore_eos=f.bool("ignore_eos", False),
            include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
            skip_special_tokens=f.bool("skip_special_tokens", True),
            speculative=f.bool("speculative", True),
            logprobs=logprobs,
            presence_penalty=f.float("presence_penalty", 0.0),
            frequency_penalty=f.float("frequency_penalty", 0.0),
            repetition_penalty=f.float("repetition_penalty", defaults.get("repetition_penalty", 1.0)),
            logit_bias=bias or None,
            allowed_token_ids=allowed,
            bad_words=bad_words,
            structured_outputs=_structured_outputs(f),
            prompt_logprobs=f.int("prompt_logprobs"),
            timeout_s=f.float("timeout_s"),
            thinking_token_budget=f.int("thinking_token_budget"),
        )
    except InvalidRequestError as e:
        raise api_error(e) from None


def _top_k(f: Fields, default: int) -> int:
    top_k = f.int("top_k", default)
    return 0 if top_k == -1 else top_k  # -1 is vLLM's (and OpenAI clients') "off", as 0 is


def generation_request(
    cls: type[R],
    f: Fields,
    max_tokens: int | None,
    logprobs: int | None,
    allow_priority: bool,
    limits: RequestLimits,
    defaults: Mapping[str, float],
    **own: Any,
) -> R:
    """A ``cls`` request: the fields every generation request shares read from ``f``, ``own`` its family's."""
    stream = f.bool("stream", False)
    stream_options = f.get("stream_options", dict)
    include_usage = continuous = False
    if stream_options is not None:
        if not stream:
            raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
        sf = Fields(stream_options, STREAM_OPTIONS, "stream_options.")
        include_usage = sf.bool("include_usage", False)
        continuous = sf.bool("continuous_usage_stats", False)
    priority = f.int("priority", 0)
    if priority and not allow_priority:
        raise bad("priority is only honoured with --scheduling-policy priority.", "priority")
    request_id = f.str("request_id")
    if request_id is not None and not request_id:
        raise bad("request_id cannot be empty.", "request_id")
    params = _sampling_params(f, max_tokens, logprobs, limits, defaults)
    if stream and params.prompt_logprobs is not None:
        raise bad("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return cls(
        model=f.str("model"),
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        request_id=request_id,
        priority=priority,
        user=f.str("user"),
        want_prompt_logprobs=params.prompt_logprobs is not None,
        **own,
    )


def parse_prompt(
    prompt: object, limits: RequestLimits = DEFAULT_LIMITS, name: str = "prompt"
) -> list[str | list[int]]:
    """str | [str] | [int] | [[int]] (checked against PROMPT) -> prompts, each a string or token ids;
    ``name``: the field's, for errors."""
    if prompt is None:
        raise bad(f"{name} is required.", name)
    PROMPT.check(prompt, name, SchemaContext(limits))
    if isinstance(prompt, str):
        return [prompt]
    assert isinstance(prompt, list)
    if isinstance(prompt[0], str):
        return list(prompt)
    if isinstance(prompt[0], list):
        return [_ints(p) or [] for p in prompt]
    return [_ints(prompt) or []]


def shaped(f: Fields, name: str, shape: Shape, ctx: SchemaContext) -> Any:
    """The field's value checked against its shape (None when absent or null)."""
    value = f.data.get(name)
    if value is not None:
        shape.check(value, name, ctx)
    return value


@dataclass(slots=True)
class TokenizeRequest:
    model: str | None
    prompt: str | None = None
    messages: list[JSON] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: JSON = field(default_factory=dict)


def parse_tokenize_request(data: JSON, limits: RequestLimits = DEFAULT_LIMITS) -> TokenizeRequest:
    f = Fields(data, TOKENIZE, limits=limits)
    has_prompt, has_messages = "prompt" in data, "messages" in data
    if has_prompt == has_messages:
        raise bad("Exactly one of prompt and messages is required.", "prompt")
    req = TokenizeRequest(f.str("model"), return_token_strs=f.bool("return_token_strs", False))
    if has_prompt:
        req.prompt = f.str("prompt")
        if req.prompt is None:
            raise bad("prompt must be a string.", "prompt")
        req.add_special_tokens = f.bool("add_special_tokens", True)
    else:
        req.messages = parse_messages(data["messages"], limits)
        req.add_special_tokens = f.bool("add_special_tokens", False)
        kwargs = template_kwargs(f)
        kwargs["add_generation_prompt"] = f.bool("add_generation_prompt", True)
        if f.bool("continue_final_message", False):
            kwargs.update(continue_final_message=True, add_generation_prompt=False)
        req.chat_template_kwargs = kwargs
    return req


def parse_detokenize_request(data: JSON, vocab_size: int) -> tuple[str | None, list[int]]:
    f = Fields(data, DETOKENIZE)
    raw = shaped(f, "tokens", TOKENS, SchemaContext(vocab_size=vocab_size))
    if raw is None:
        raise bad("tokens is required.", "tokens")
    return f.str("model"), _ints(raw) or []
