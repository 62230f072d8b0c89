"""A stand-in for AsyncEngine (no model): each request streams one token, then waits until it is aborted
or the engine "dies". Used to test engine death without killing the real engine."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aioengine.errors import EngineDeadError
from aioengine.outputs import CompletionOutput, RequestOutput


class FakeHandle:
    def __init__(self, engine: FakeEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(RequestOutput(request_id, "p", [1, 2], [CompletionOutput(0, "Hello", [7])]))

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
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

    def __await__(self):
        async def final():
            async for out in self:
                if out.finished:
                    return out
        return final().__await__()


class FakeEngine:
    def __init__(self) -> None:
        self.model_name = "fake"
        self.model_path = None
        self.max_model_len = 128
        self.vocab_size = 100
        self.tokenizer = None
        self.dead_error: EngineDeadError | None = None
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.stat_listeners: list = []
        self.request_listeners: list = []
        self.live: dict[str, FakeHandle] = {}
        self.shut_down = False
        self.default_sampling_params: dict = {}

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self.shut_down

    def kv_cache_usage(self) -> float:
        return 0.0

    def num_unfinished_requests(self) -> int:
        return len(self.live)

    def generate(self, prompt, params=None, request_id=None, priority=0) -> FakeHandle:
        if self.dead_error is not None:
            raise self.dead_error
        h = self.live[request_id] = FakeHandle(self, request_id)
        return h

    def chat(self, messages, params=None, request_id=None, priority=0, chat_template_kwargs=None) -> FakeHandle:
        return self.generate("", params, request_id, priority)

    async def precompile(self, params) -> None:
        pass  # no grammars here

    async def abort(self, request_id: str) -> bool:
        h = self.live.pop(request_id, None)
        if h is not None:
            h.queue.put_nowait(RequestOutput(request_id, "p", [1, 2], [CompletionOutput(0, "", [], "abort")], True))
        return h is not None

    def die(self) -> None:
        self.dead_error = EngineDeadError("engine step failed: RuntimeError('boom')")
        for h in list(self.live.values()):
            h.queue.put_nowait(self.dead_error)
        self.live.clear()

    async def shutdown(self) -> None:
        for rid in list(self.live):
            await self.abort(rid)
        self.shut_down = True
