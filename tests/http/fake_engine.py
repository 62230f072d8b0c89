"""A stand-in for AsyncEngine (no model), implementing EngineClient: each request streams one token, then
waits until it is aborted or the engine "dies". Used to test engine death without killing the real engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator, Mapping
from typing import Any

from aioengine.engine.client import (
    EngineClient,
    EngineStats,
    PrecompiledGrammar,
    RankStats,
    RequestHandle,
    RequestListener,
    StatListener,
)
from aioengine.errors import EngineDeadError, InvalidRequestError
from aioengine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from aioengine.sampling_params import SamplingParams


class FakeTokenizer:
    """One token per character (ids are code points modulo the vocabulary)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) % self.vocab_size for ch in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(t) for t in ids]

    def __len__(self) -> int:
        return self.vocab_size


class FakeHandle:
    def __init__(self, engine: FakeEngine, request_id: str) -> None:
        self.engine = engine
        self._request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queue.put_nowait(RequestOutput(request_id, "p", [1, 2], [CompletionOutput(0, "Hello", [7])]))

    @property
    def request_id(self) -> str:
        return self._request_id

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        return self._iterate()

    async def _iterate(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.engine.live.pop(self.request_id, None)

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        async def final() -> RequestOutput:
            async for out in self:
                if out.finished:
                    return out
            raise AssertionError("the stream ended without a finished output")

        return final().__await__()


class FakeEngine:
    def __init__(self) -> None:
        self.model_name = "fake"
        self.model_path: str | None = None
        self.max_model_len = 128
        self.vocab_size = 100
        self.tokenizer = FakeTokenizer(self.vocab_size)
        self.default_sampling_params: Mapping[str, float] = {}
        self.allow_priority = False
        self.lora_modules: dict[str, str] = {}
        self.allow_lora_updates = False
        self.dead_error: EngineDeadError | None = None
        self.stat_listeners: list[StatListener] = []
        self.request_listeners: list[RequestListener] = []
        self.stopped = asyncio.Event()
        self.live: dict[str, FakeHandle] = {}
        self.shut_down = False

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self.shut_down

    def rank_stats(self) -> list[RankStats]:
        return [RankStats(0, 0, 0.0)]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.live), num_waiting=0, kv_cache_usage=0.0, num_unfinished=len(self.live)
        )

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        grammar: PrecompiledGrammar | None = None,
        lora: str | None = None,
    ) -> RequestHandle:
        if self.dead_error is not None:
            raise self.dead_error
        rid = request_id if request_id is not None else f"fake-{len(self.live)}"
        h = self.live[rid] = FakeHandle(self, rid)
        return h

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        grammar: PrecompiledGrammar | None = None,
        lora: str | None = None,
    ) -> RequestHandle:
        return self.generate("", sampling_params, request_id, priority)

    async def load_lora(self, name: str, path: str) -> None:
        raise InvalidRequestError("loading LoRA adapters at run time needs --enable-lora-runtime-updates")

    async def unload_lora(self, name: str) -> None:
        raise InvalidRequestError("unloading LoRA adapters needs --enable-lora-runtime-updates")

    def render_chat(
        self, messages: list[dict], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """No template here: each message's text, one token per character."""
        return self.tokenizer.encode("".join(str(m.get("content", "")) for m in messages))

    async def precompile(self, params: SamplingParams) -> PrecompiledGrammar | None:
        return None  # no grammars here

    async def embed(
        self,
        input: str | list[int] | list[str] | list[list[int]] | list[str | list[int]],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput | list[EmbeddingRequestOutput]:
        if self.dead_error is not None:
            raise self.dead_error
        one = EmbeddingRequestOutput(request_id or "fake", [1, 2], EmbeddingOutput([0.6, 0.8]))
        return one if isinstance(input, str) or (input and type(input[0]) is int) else [one] * len(input)

    async def abort(self, request_id: str) -> bool:
        h = self.live.pop(request_id, None)
        if h is not None:
            h.queue.put_nowait(
                RequestOutput(request_id, "p", [1, 2], [CompletionOutput(0, "", [], "abort")], True)
            )
        return h is not None

    def die(self) -> None:
        self.dead_error = EngineDeadError("engine step failed: RuntimeError('boom')")
        for h in list(self.live.values()):
            h.queue.put_nowait(self.dead_error)
        self.live.clear()
        self.stopped.set()

    async def shutdown(self) -> None:
        for rid in list(self.live):
            await self.abort(rid)
        self.shut_down = True
        self.stopped.set()


def _implements_the_protocol(engine: FakeEngine) -> EngineClient:
    return engine  # mypy checks FakeEngine against EngineClient here
