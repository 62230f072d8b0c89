"""Admission, shared by every generation route (HTTP and websocket), in the order a request meets it:
backpressure, the body, parsing, the model name and request id, the slow preparation off the loop
(tokenizing long prompts, compiling a grammar), backpressure again, then the one engine call.

Errors are raised: APIError as it is, the engine's AioEngineError for the caller to map (fields.api_error).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import orjson
from aiohttp import web

from aioengine.engine.client import EngineClient, PrecompiledGrammar, RequestHandle
from aioengine.errors import AioEngineError, InvalidRequestError
from aioengine.http.context import CONFIG, ENGINE, STATE, check_model, lora_of
from aioengine.http.errors import APIError, api_error, bad
from aioengine.http.parsing import ChatRequest, CompletionRequest
from aioengine.http.reasoning import HARMONY, closed_in_prompt
from aioengine.http.request_tables import REQUEST_ID_PATTERN
from aioengine.http.schema import RequestLimits, parse_json_body

logger = logging.getLogger("aioengine.http")

_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
LOG_PROMPT_CHARS = 256  # --log-requests: how much of a prompt is logged
# Prompts longer than this (in characters) are tokenized on a worker thread: on the loop, a prompt of
# megabytes stalls every stream for seconds; the tokenizer releases the GIL, so the loop keeps serving.
OFFLOAD_CHARS = 1 << 16
_PROMPT_TAIL = 64  # tokens of a rendered chat prompt that hold its generation prompt (and any think block)

R = TypeVar("R", ChatRequest, CompletionRequest)
# parse_chat_request / parse_completion_request: (body, allow_priority, limits, generation defaults) -> req
Parser = Callable[[dict[str, Any], bool, RequestLimits, Mapping[str, float]], R]


@dataclass(slots=True)
class Admitted(Generic[R]):
    """A parsed request that may start: what it asks for, under which model name and request id."""

    req: R
    model: str
    request_id: str
    grammar: PrecompiledGrammar | None = None  # its structured-output grammar, compiled off the loop


def check_draining(app: web.Application) -> None:
    """Refuse at once (503 + Retry-After) while the server shuts down."""
    if app[STATE].draining:
        retry = {"Retry-After": str(app[CONFIG].retry_after_s)}
        raise APIError(503, "The server is shutting down.", code="shutting_down", headers=retry)


def check_capacity(app: web.Application) -> None:
    """Backpressure: refuse at once (503 + Retry-After) while draining or when the engine's queue is full."""
    check_draining(app)
    retry = {"Retry-After": str(app[CONFIG].retry_after_s)}
    limit = app[CONFIG].max_num_queued_reqs
    if limit is None:
        return
    waiting = app[ENGINE].stats().num_waiting
    if waiting >= limit:
        raise APIError(
            503,
            f"The server is busy: {waiting} requests are already waiting "
            f"(--max-num-queued-reqs {limit}). Retry later.",
            code="queue_full",
            headers=retry,
        )


async def read_json(request: web.Request) -> dict[str, Any]:
    return parse_json_body(await request.read(), request.app[CONFIG].limits.max_json_depth)


async def admit_request(request: web.Request, parse: Parser[R], id_prefix: str) -> Admitted[R]:
    """An HTTP generation request: refused before its body is read when the queue is full."""
    check_capacity(request.app)
    body = await read_json(request)
    return await admit_body(request.app, body, parse, request.headers.get("X-Request-Id"), id_prefix)


async def admit_translated(
    request: web.Request,
    translate: Callable[[dict[str, Any]], dict[str, Any]],
    parse: Parser[ChatRequest],
    id_prefix: str,
) -> tuple[dict[str, Any], Admitted[ChatRequest]]:
    """Another API's body (Responses, Messages), admitted as the chat request ``translate`` makes of it and
    ``parse`` (the chat route's parser) reads; returns the body too, for the route's own reply."""
    check_capacity(request.app)
    data = await read_json(request)
    adm = await admit_body(
        request.app, translate(data), parse, request.headers.get("X-Request-Id"), id_prefix
    )
    return data, adm


async def admit_body(
    app: web.Application, body: dict[str, Any], parse: Parser[R], given_id: str | None, id_prefix: str
) -> Admitted[R]:
    """Parse ``body`` and prepare it; ``given_id`` (the X-Request-Id header) wins over its request_id."""
    engine = app[ENGINE]
    cfg = app[CONFIG]
    req = parse(body, engine.allow_priority, cfg.limits, engine.default_sampling_params)
    if isinstance(req, ChatRequest) and cfg.reasoning_parser == HARMONY:
        _harmony(req)
    elif isinstance(req, ChatRequest):
        req.params.reasoning_parser = cfg.reasoning_parser  # the think block's rules, for a thinking budget
        structured = req.params.structured_outputs
        if structured is not None and not cfg.structured_outputs_in_reasoning:
            structured.reasoning = (
                cfg.reasoning_parser
            )  # the constraint starts after the think block, as vLLM's
    model = check_model(app, req.model)
    rid = request_id(given_id or req.request_id, id_prefix)
    grammar = await prepare(engine, req)
    check_capacity(app)  # again: other requests may have queued while this one was prepared
    return Admitted(req, model, rid, grammar)


def _harmony(req: ChatRequest) -> None:
    """gpt-oss's harmony markup is special tokens, decoded for the parser; the think-block tools (a
    thinking budget, a grammar that starts after the block) do not know its channels."""
    if req.tools is not None and req.tools.choice in ("required", "named"):
        # forcing a call constrains the whole output, harmony's markup included
        raise bad(
            "tool_choice required or a named function is not supported with --reasoning-parser openai_gptoss",
            "tool_choice",
        )
    if req.params.structured_outputs is not None:
        raise bad(
            "structured outputs are not supported with --reasoning-parser openai_gptoss",
            "response_format",
        )
    if req.params.thinking_token_budget is not None:
        raise bad(
            "thinking_token_budget is not supported with --reasoning-parser openai_gptoss",
            "thinking_token_budget",
        )
    req.params.skip_special_tokens = False


def request_id(given: str | None, prefix: str) -> str:
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not _REQUEST_ID_RE.match(given):
        raise bad(
            "request_id (or the X-Request-Id header) must be 1-128 letters, digits or ._:-", "request_id"
        )
    return given


async def prepare(engine: EngineClient, req: ChatRequest | CompletionRequest) -> PrecompiledGrammar | None:
    """The slow parts of starting a request, off the event loop (the tokenizer and xgrammar release the
    GIL): compile the grammar, once, for the engine call; tokenize (chat: template) prompts over
    OFFLOAD_CHARS characters into ``req.prompt_ids``. A chat whose answer alone is constrained is rendered
    first in any case: where its template already closed the think block, the constraint covers it all."""
    grammar = None
    structured = req.params.structured_outputs
    if isinstance(req, ChatRequest):
        size = sum(len(m["content"]) for m in req.messages)
        if req.tools is not None:  # the template renders them too (Qwen's writes each as JSON)
            size += len(orjson.dumps(req.tools.tools))
        if size > OFFLOAD_CHARS:
            req.prompt_ids = await asyncio.to_thread(
                engine.render_chat, req.messages, req.chat_template_kwargs
            )
        elif (
            structured is not None and structured.reasoning is not None
        ):  # the prompt decides where the constraint starts
            req.prompt_ids = engine.render_chat(req.messages, req.chat_template_kwargs)
        if structured is not None and structured.reasoning is not None and req.prompt_ids is not None:
            tail = engine.tokenizer.decode(req.prompt_ids[-_PROMPT_TAIL:])
            if closed_in_prompt(tail):  # the template closed the block itself: constrain all, as vLLM does
                structured.reasoning = None
    if structured is not None:
        try:
            grammar = await engine.precompile(req.params)
        except InvalidRequestError as e:
            if isinstance(req, ChatRequest) and req.tools is not None and req.tools.structured_outputs():
                raise bad(f"A tool's parameters schema cannot force the call: {e.message}", "tools") from None
            raise
    if isinstance(req, ChatRequest):
        return grammar
    for i, p in enumerate(req.prompts):
        if isinstance(p, str) and len(p) > OFFLOAD_CHARS:
            req.prompt_ids[i] = list(await asyncio.to_thread(engine.tokenizer.encode, p))
    return grammar


# ---- the engine call ------------------------------------------------------------------------------------
def start_chat(app: web.Application, adm: Admitted[ChatRequest], what: str) -> RequestHandle:
    """The chat request's one engine request (its n completions come in each output)."""
    engine, req = app[ENGINE], adm.req
    if req.prompt_ids is not None:
        handle = engine.generate(
            req.prompt_ids,
            req.params,
            request_id=adm.request_id,
            priority=req.priority,
            grammar=adm.grammar,
            lora=lora_of(app, adm.model),
        )
    else:
        handle = engine.chat(
            req.messages,
            req.params,
            request_id=adm.request_id,
            priority=req.priority,
            chat_template_kwargs=req.chat_template_kwargs or None,
            grammar=adm.grammar,
            lora=lora_of(app, adm.model),
        )
    log_start(app, adm, what)
    return handle


async def start_completions(
    app: web.Application, adm: Admitted[CompletionRequest], what: str
) -> list[RequestHandle]:
    """One engine request per prompt; one bad prompt fails (and aborts) the whole batch."""
    engine, req = app[ENGINE], adm.req
    handles: list[RequestHandle] = []
    try:
        for i, prompt in enumerate(req.prompts):
            rid = adm.request_id if len(req.prompts) == 1 else f"{adm.request_id}-{i}"
            handles.append(
                engine.generate(
                    req.prompt_ids.get(i, prompt),
                    req.params,
                    request_id=rid,
                    priority=req.priority,
                    grammar=adm.grammar,
                    lora=lora_of(app, adm.model),
                )
            )
    except AioEngineError as e:
        for h in handles:
            await engine.abort(h.request_id)
        err = api_error(e)
        if len(req.prompts) > 1 and err.status == 400:
            err.message = f"prompt[{len(handles)}]: {err.message}"
        raise err from None
    log_start(app, adm, what)
    return handles


def log_start(
    app: web.Application, adm: Admitted[ChatRequest] | Admitted[CompletionRequest], what: str
) -> None:
    """With --log-requests only: prompts and parameters never reach the logs otherwise."""
    if app[CONFIG].log_requests:
        req = adm.req
        prompt = req.messages if isinstance(req, ChatRequest) else req.prompts
        logger.info(
            "Received request %s (%s): prompt=%.*s params=%s stream=%s user=%s",
            adm.request_id,
            what,
            LOG_PROMPT_CHARS,
            repr(prompt),
            req.params,
            req.stream,
            req.user,
        )
