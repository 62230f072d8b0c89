"""POST /v1/completions: admission, one engine request per prompt, then OpenAI's text_completion JSON or its
SSE stream (choice index = prompt index * n + completion index; `echo` puts the prompt first)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from aioengine.engine.client import EngineClient, RequestHandle
from aioengine.http import admission
from aioengine.http.admission import Admitted
from aioengine.http.context import ENGINE, json_response
from aioengine.http.logprobs import CompletionLogprobs, LegacyLogprobs, prompt_logprobs_json
from aioengine.http.parsing import CompletionRequest, parse_completion_request
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
