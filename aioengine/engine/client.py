"""The typed seam between the HTTP server (aioengine/http/) and an engine: everything the server may use.

AsyncEngine implements EngineClient, and so does tests/http/fake_engine.py; the server holds an EngineClient,
never an AsyncEngine. This module imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aioengine.errors import EngineDeadError
from aioengine.outputs import EmbeddingRequestOutput, RankStats, RequestOutput
from aioengine.sampling_params import SamplingParams, StructuredOutputsParams
from aioengine.sched.output import EngineCoreOutput, SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load, read on the loop (cheap: a few lengths)."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued for their first (or next, after preemption) step
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    num_unfinished: int  # requests started and not finished (running, waiting or being aborted)
    # LoRA (vLLM's lora_requests_info): the adapters of the running and waiting requests, and the slots
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0  # 0: LoRA is off


@dataclass(frozen=True, slots=True, eq=False)
class PrecompiledGrammar:
    """What precompile() returns: the grammar of ``spec``, compiled once, for generate()/chat() to reuse."""

    spec: StructuredOutputsParams  # generate() uses ``compiled`` only for this very object
    compiled: object  # opaque: the structured-output backend's compiled grammar


class Tokenizer(Protocol):
    """The tokenizer calls the server makes (a transformers tokenizer has them)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def __len__(self) -> int: ...


class RequestInfo(Protocol):
    """What a request listener learns about a request besides its output (the engine's RequestState)."""

    @property
    def request_id(self) -> str: ...

    @property
    def child_ids(self) -> list[str]: ...

    @property
    def arrival_time(self) -> float: ...  # time.monotonic() when generate() was called

    @property
    def first_scheduled_time(self) -> float | None: ...  # when a step first planned it (None: not yet)

    @property
    def first_token_time(self) -> float | None: ...

    @property
    def lora(self) -> str | None: ...  # the LoRA adapter it runs under (None: the base model)


# Called inside the engine step, so they must be cheap and never block: no I/O, no awaits.
RequestListener = Callable[[RequestOutput, RequestInfo], None]  # every step's output of every request
StatListener = Callable[[SchedulerStats, list[EngineCoreOutput]], None]  # once per processed step


class RequestHandle(Protocol):
    """One started request: ``await`` it for the final output, or ``async for`` over its deltas."""

    @property
    def request_id(self) -> str: ...

    def __aiter__(self) -> AsyncGenerator[RequestOutput, None]: ...  # close it (aclosing) to abort early

    def __await__(self) -> Generator[Any, None, RequestOutput]: ...


class EngineClient(Protocol):
    """A started engine as the HTTP server sees it.

    generate/chat raise InvalidRequestError for a request that can never run and EngineDeadError once the
    engine is dead (AioEngineError both); the server maps them to API errors in one place.
    """

    # ---- model info ----------------------------------------------------------------------------------
    @property
    def model_name(self) -> str: ...

    @property
    def model_path(self) -> str | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def default_sampling_params(self) -> Mapping[str, float]: ...  # from the model's generation config

    @property
    def allow_priority(self) -> bool: ...  # requests may set `priority` (--scheduling-policy priority)

    @property
    def lora_modules(self) -> Mapping[str, str]: ...  # LoRA adapters served beside the model: name -> path

    @property
    def allow_lora_updates(self) -> bool: ...  # load_lora / unload_lora work (--enable-lora-runtime-updates)

    async def load_lora(self, name: str, path: str) -> None: ...  # InvalidRequestError: nothing loaded

    async def unload_lora(self, name: str) -> None: ...

    def render_chat(
        self, messages: list[dict], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The prompt token ids of a chat, rendered by the model's template (the one place that renders it);
        raises InvalidRequestError for messages the template refuses."""
        ...

    # ---- requests ------------------------------------------------------------------------------------
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
    ) -> RequestHandle: ...

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
    ) -> RequestHandle: ...

    async def precompile(self, params: SamplingParams) -> PrecompiledGrammar | None: ...

    async def embed(
        self,
        input: str | list[int] | list[str] | list[list[int]] | list[str | list[int]],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput | list[EmbeddingRequestOutput]: ...  # one output per input, in order

    async def abort(self, request_id: str) -> bool: ...

    # ---- state ---------------------------------------------------------------------------------------
    def stats(self) -> EngineStats: ...

    def rank_stats(self) -> list[RankStats]: ...  # each rank's steps and busy seconds (metrics)

    @property
    def stat_listeners(self) -> list[StatListener]: ...

    @property
    def request_listeners(self) -> list[RequestListener]: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> EngineDeadError | None: ...

    @property
    def stopped(self) -> asyncio.Event: ...  # set once the engine has died or shut down

    async def shutdown(self) -> None: ...
