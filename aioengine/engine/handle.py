"""The per-request state of a generate() call and the handle it returns (await it, or iterate its deltas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from aioengine.model.tokenizer import IncrementalDetokenizer
from aioengine.outputs import CompletionOutput, RequestOutput
from aioengine.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class RequestState:
    """One generate() call: its n completions, their detokenizers, and the stream to its consumer."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str]
    detokenizers: list[IncrementalDetokenizer]
    queue: asyncio.Queue
    child_done: list[bool]
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # when a step first planned one of its completions
    finished: bool = False
    prompt_logprobs: list | None = None  # set once, from the first completion that delivers them
    pending_prompt_logprobs: list | None = None  # to attach to the next output
    final_only: bool = False  # the consumer awaits the final output only: deltas may be buffered for it
    buffered: list[CompletionOutput] = field(default_factory=list)  # deltas not yet sent, oldest first
    embedding: Any = None  # an embedding request's vector (numpy), set with its finish
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)


class RequestOwner(Protocol):
    """What a handle needs of its engine (AsyncEngine): typed here so that handle.py never imports it."""

    def _abort_state(self, state: RequestState, reason: str = "abort") -> None: ...


class GenerateHandle:
    """What generate() returns: `await` it for the final output, or `async for` over its deltas.

    Leaving an `async for` early, or cancelling the await, aborts the request.
    """

    def __init__(self, engine: RequestOwner, state: RequestState) -> None:
        self._engine = engine
        self._state = state
        self._consumed = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def embedding(self) -> Any:
        """An embedding request's unit vector (numpy float32) once it has finished, else None."""
        return self._state.embedding

    def abort(self) -> None:
        """Abort this request now (its stream ends with finish_reason 'abort'); a no-op once finished."""
        self._engine._abort_state(self._state)

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        return self._iterate()

    def __await__(self) -> Generator[Any, None, RequestOutput]:
        return self._final().__await__()

    async def _iterate(self) -> AsyncGenerator[RequestOutput, None]:
        assert not self._consumed, "a generate() result can be consumed once"
        self._consumed = True
        state = self._state
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.finished:
                self._engine._abort_state(state)

    async def _final(self) -> RequestOutput:
        s = self._state
        s.final_only = True
        texts = [""] * s.params.n
        ids: list[list[int]] = [[] for _ in range(s.params.n)]
        reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * s.params.n
        logprobs: list[list | None] = [
            [] if s.params.logprobs is not None else None for _ in range(s.params.n)
        ]
        prompt_logprobs = None
        last: RequestOutput | None = None
        async for delta in self._iterate():
            last = delta
            if delta.prompt_logprobs is not None:
                prompt_logprobs = delta.prompt_logprobs
            for c in delta.outputs:
                texts[c.index] += c.text
                ids[c.index].extend(c.token_ids)
                if c.finish_reason is not None:
                    reasons[c.index] = (c.finish_reason, c.stop_reason)
                kept = logprobs[c.index]
                if c.logprobs and kept is not None:
                    kept.extend(c.logprobs)
        assert last is not None
        outputs = [CompletionOutput(i, texts[i], ids[i], *reasons[i], logprobs[i]) for i in range(s.params.n)]
        return RequestOutput(
            s.request_id,
            s.prompt,
            s.prompt_token_ids,
            outputs,
            True,
            s.num_cached_tokens,
            last.metrics,
            prompt_logprobs,
        )
