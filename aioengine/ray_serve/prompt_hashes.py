"""A request's prompt as the engine will chain its KV blocks: the route's own parser, the model's chat
template and tokenizer, and the KV cache manager's block hash, run in the ingress so that the router can score
replicas by the blocks they hold. A body the hasher cannot read gets no hashes: it is routed by load, and
the replica answers it (with its own error, if it is bad)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

from aioengine.http.anthropic.messages import to_chat_body as anthropic_chat_body
from aioengine.http.openai.chat import parse_chat_request
from aioengine.http.openai.completions import parse_completion_request
from aioengine.http.openai.responses import to_chat_body as responses_chat_body
from aioengine.model.tokenizer import apply_chat_template, raw_encoder
from aioengine.ray_serve.calls import RoutingInfo
from aioengine.sched.block_pool import chain_block_hashes

logger = logging.getLogger("aioengine.ray_serve")

CHAT_ROUTES: dict[str, Callable[[Any], dict[str, Any]] | None] = {
    "/v1/chat/completions": None,
    "/v1/messages": anthropic_chat_body,
    "/v1/responses": responses_chat_body,
}
PROMPT_ROUTES = frozenset({*CHAT_ROUTES, "/v1/completions"})


class PromptHasher:
    def __init__(self, info: RoutingInfo, max_blocks: int = 8192) -> None:
        """``max_blocks``: the longest prefix scored (a longer prompt's tail decides nothing)."""
        self.info, self.max_blocks = info, max_blocks
        tokenizer = info.tokenizer
        # the engine's own encode for a text prompt (AsyncEngine._encode)
        self._encode: Callable[..., list[int]] | None = None
        if tokenizer is not None:
            self._encode = raw_encoder(tokenizer) or tokenizer.encode

    def hashes(self, path: str, body: bytes) -> list[int]:
        """The chained hashes of the prompt's full blocks; [] where none can be had."""
        if path not in PROMPT_ROUTES or not self.info.prefix_caching or self._encode is None:
            return []
        try:
            data = orjson.loads(body)
            if not isinstance(data, dict) or data.get("model") in self.info.lora_names:
                return []
            ids = self._prompt_ids(path, data)
        except Exception as e:  # a bad body, or a template that fails on it: the replica will say why
            logger.debug("no prompt hashes for %s: %r", path, e)
            return []
        if ids is None:
            return []
        bs = self.info.block_size
        return chain_block_hashes(ids[: self.max_blocks * bs], bs)

    def _prompt_ids(self, path: str, data: dict[str, Any]) -> list[int] | None:
        assert self._encode is not None
        if path == "/v1/completions":
            prompts = parse_completion_request(data).prompts
            if len(prompts) != 1:  # several prompts run as several requests on one replica
                return None
            p = prompts[0]
            return list(p) if not isinstance(p, str) else list(self._encode(p))
        translate = CHAT_ROUTES[path]
        req = parse_chat_request(translate(data) if translate is not None else data)
        return apply_chat_template(self.info.tokenizer, req.messages, **req.chat_template_kwargs)
