"""POST /v1/completions: admission, one engine request per prompt, then OpenAI's text_completion JSON or its
SSE stream (choice index = prompt index * n + completion index; `echo` puts the prompt first)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.context import ENGINE, json_response
from aioengine.http.errors import bad, not_supported
from aioengine.http.logprobs import CompletionLogprobs, LegacyLogprobs, prompt_logprobs_json
from aioengine.http.parsing import CompletionRequest, generation_request, parse_prompt
from aioengine.http.request_tables import MAX_TOKENS_NOTE, PROMPT, SAMPLING, sampled
from aioengine.http.schema import DEFAULT_LIMITS, Fields, RequestLimits, Spec, Table
from aioengine.http.streaming import JSON, Tally, stream_choices
from aioengine.outputs import CompletionOutput, PromptLogprobs, RequestOutput


async def completions(request: web.Request) -> web.StreamResponse:
    adm = await admission.admit_request(request, parse_completion_request, "cmpl")
    handles = await admission.start_completions(
        request.app, adm, f"completion, {len(adm.req.prompts)} prompts"
    )
    engine = request.app[ENGINE]
    if adm.req.stream:
        return await stream_completions(request, engine, adm, handles)
    outs = list(await asyncio.gather(*handles))
    return json_response(text_completion(engine, adm, outs), headers={"X-Request-Id": adm.request_id})


def prompt_text(engine: EngineClient, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)


def text_completion(
    engine: EngineClient, adm: Admitted[CompletionRequest], outs: list[RequestOutput]
) -> JSON:
    """The text_completion object of finished requests (one per prompt)."""
    req = adm.req
    n, k = req.params.n, req.params.logprobs
    choices = []
    for i, out in enumerate(outs):
        echo = prompt_text(engine, req.prompts[i]) if req.echo else ""
        for c in out.outputs:
            lp = None
            if k is not None:
                renderer = CompletionLogprobs(engine, k)
                lp = _joined(
                    renderer.render(out.prompt_token_ids, out.prompt_logprobs) if req.echo else None,
                    renderer.render(c.token_ids, c.logprobs),
                )
            choice = {
                "index": i * n + c.index,
                "text": echo + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.want_prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_json(engine, out.prompt_logprobs)
            choices.append(choice)
    return {
        "id": adm.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": adm.model,
        "choices": choices,
        "usage": Tally.of(outs).usage(),
    }


async def stream_completions(
    request: web.Request, engine: EngineClient, adm: Admitted[CompletionRequest], handles: list[RequestHandle]
) -> web.StreamResponse:
    req = adm.req
    n, k = req.params.n, req.params.logprobs
    base = {
        "id": adm.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": adm.model,
    }
    renderers: dict[int, CompletionLogprobs] = {}
    prompt_logprobs: dict[int, PromptLogprobs] = {}  # per prompt, from its first output

    def choice(i: int, c: CompletionOutput, out: RequestOutput) -> JSON:
        index = i * n + c.index
        lp, text = None, c.text
        if k is not None:
            echoed = None
            if index not in renderers:
                renderers[index] = CompletionLogprobs(engine, k)
                if req.echo:  # the prompt goes out with this choice's first chunk, with its logprobs
                    text = prompt_text(engine, req.prompts[i]) + text
                    echoed = renderers[index].render(out.prompt_token_ids, prompt_logprobs.get(i))
            lp = _joined(echoed, renderers[index].render(c.token_ids, c.logprobs))
        d: JSON = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
        if c.finish_reason:
            d["stop_reason"] = c.stop_reason
        return d

    def on_output(i: int, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs

    first: list[JSON] = []
    if req.echo and k is None:
        first = [
            {"index": i * n + j, "text": prompt_text(engine, p), "logprobs": None, "finish_reason": None}
            for i, p in enumerate(req.prompts)
            for j in range(n)
        ]
    return await stream_choices(request, engine, req, handles, adm.request_id, base, first, choice, on_output)


def _joined(a: LegacyLogprobs | None, b: LegacyLogprobs) -> LegacyLogprobs:
    return b if a is None else {key: a[key] + b[key] for key in a}


# ---- the request: its fields (/openapi.json states them) and its parser --------------------------------
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default max_tokens (OpenAI's)


COMPLETION: Table = {
    **SAMPLING,
    "prompt": Spec(None, schema=PROMPT.schema),
    "max_tokens": sampled(
        int, "max_tokens", schema={"default": COMPLETION_MAX_TOKENS}, description=MAX_TOKENS_NOTE
    ),
    "echo": Spec(bool),
    "best_of": Spec(int, lo=1, description="only equal to n"),
    "suffix": Spec(str, schema={"maxLength": 0}),  # not supported: only empty
    "logprobs": sampled(
        int, "logprobs", later=False, description="with echo, the prompt tokens get logprobs too"
    ),
}


COMPLETION_REQUIRED = ("prompt",)


def parse_completion_request(
    data: JSON,
    allow_priority: bool = False,
    limits: RequestLimits = DEFAULT_LIMITS,
    defaults: Mapping[str, float] | None = None,
) -> CompletionRequest:
    f = Fields(data, COMPLETION, limits=limits)
    prompts = parse_prompt(data.get("prompt"), limits)
    logprobs = f.int("logprobs")
    echo = f.bool("echo", False)
    if f.str("suffix"):
        raise not_supported("suffix")
    req = generation_request(
        CompletionRequest,
        f,
        f.int("max_tokens", COMPLETION_MAX_TOKENS),
        logprobs,
        allow_priority,
        limits,
        defaults or {},
        prompts=prompts,
        echo=echo,
    )
    if echo and logprobs is not None and req.params.prompt_logprobs is None:  # the echoed prompt's own
        req.params.prompt_logprobs = logprobs
    best_of = f.int("best_of")
    if best_of is not None and best_of != req.params.n:
        raise not_supported("best_of", "best_of other than n")
    if len(prompts) * req.params.n > limits.max_prompts:
        raise bad(f"A request may ask for at most {limits.max_prompts} completions (prompts x n).", "prompt")
    return req
