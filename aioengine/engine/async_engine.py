"""AsyncEngine: the step coroutine (batch queue of 2, one awaited wait per step) and generate/abort/chat."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, overload

from aioengine.config import EngineArgs
from aioengine.engine import gc_freeze, input_processor, startup
from aioengine.engine.client import EngineStats, PrecompiledGrammar, RequestListener, StatListener
from aioengine.engine.embedding import (
    EmbedInput,
    EmbedInputs,
    check_dimensions,
    embedding_output,
    split_inputs,
)
from aioengine.engine.handle import GenerateHandle, RequestState
from aioengine.engine.loras import LoRARegistry
from aioengine.engine.output_processor import OutputProcessor
from aioengine.errors import EngineDeadError, EngineNotStartedError, InvalidRequestError
from aioengine.model.lora import LoRAError
from aioengine.model.pooling import PoolingConfigError, resolve_pooling
from aioengine.model.tokenizer import IncrementalDetokenizer, apply_chat_template, raw_encoder
from aioengine.outputs import EmbeddingRequestOutput, RankStats
from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import ModelRunnerOutput, NewRequestData
from aioengine.sched.request import Request, RequestStatus
from aioengine.sched.scheduler import Scheduler

if TYPE_CHECKING:  # importing these imports torch: start() does, lazily
    from aioengine.engine.kv_disk import KVDiskTier
    from aioengine.engine.kv_offload import DiskReads
    from aioengine.executor import Executor
    from aioengine.gpu.backend import Backend
    from aioengine.gpu.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        self.args = args if args is not None else EngineArgs(**kwargs)
        self.args.validate()
        self.tokenizer: Any = None
        self._encode: Callable[..., list[int]] | None = None  # the tokenizer's encode, or its fast path
        self.runner: ModelRunner | None = None
        self.backend: Backend | None = None  # picked in start() (importing it imports torch)
        self.scheduler: Scheduler | None = None
        self.model_path: str | None = None
        self.model_name = self.args.served_model_name or self.args.model
        self.max_model_len = 0
        self.default_sampling_params: dict = {}  # from the generation config (EngineArgs.generation_config)
        self.vocab_size = 0
        self.eos_token_id: int | None = None
        self.kv_capacity_tokens = 0
        self._executor: Executor | None = None
        self._outputs = OutputProcessor()  # stop 12, and the live requests
        self._batch_queue: collections.deque = collections.deque()
        # Seconds the loop spent per phase of the step coroutine, summed ("steps": how many were awaited).
        self.host_s: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None
        self._stopping = False
        self._structured: Any = None  # StructuredOutputManager, built on a thread during start()
        self._loras = LoRARegistry(self.args.lora_modules if self.args.enable_lora else {})
        self._kv_events: Any = None  # engine/kv_events.py's publisher, with kv_events_config
        self._kv_disk: KVDiskTier | None = None  # the offload tier's block files, with kv_offload_dir
        self._disk_reads: DiskReads | None = None  # their tasks (engine/kv_offload.py)
        self._structured_build: concurrent.futures.Future | None = None
        self.pooling: str | None = None  # embed()'s, set by start()
        self._pooling_error = "the engine is not started"
        self.stat_listeners: list[StatListener] = []
        self.request_listeners: list[RequestListener] = self._outputs.request_listeners
        self._stopped = asyncio.Event()  # set once the step loop has ended: dead or shut down

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        """Resolve the config, load model and tokenizer, size the KV cache, capture (startup.py); then run
        the steps."""
        if self._task is not None:
            return self
        t0 = time.perf_counter()
        s = await startup.start(self.args, _new_structured_output_manager)
        self.backend, self._executor, self.runner, self.scheduler = (
            s.backend,
            s.executor,
            s.runner,
            s.scheduler,
        )
        self._kv_disk = s.kv_disk
        if s.kv_disk is not None:
            from aioengine.engine.kv_offload import DiskReads

            offload, kv_host = s.scheduler.kv_cache_manager.offload, s.runner.kv_host
            assert offload is not None and kv_host is not None
            self._disk_reads = DiskReads(
                s.kv_disk, offload, s.executor.submit, kv_host.fill, self._wakeup.set
            )
        s.executor.on_death(self._rank_died)
        self.tokenizer = self._outputs.tokenizer = s.tokenizer
        self._encode = raw_encoder(s.tokenizer) or s.tokenizer.encode
        self.model_path, self.model_name = s.model_path, s.model_name
        self.max_model_len = s.config.max_model_len
        self.vocab_size, self.eos_token_id = s.vocab_size, s.eos_token_id
        self.default_sampling_params = s.default_sampling_params
        self.kv_capacity_tokens = s.kv_capacity_tokens
        self.embedding_size = int(s.runner.hf_config.hidden_size)
        try:  # embed()'s pooling, for every request; a checkpoint's unknown one fails embed() only
            self.pooling = resolve_pooling(self.args.pooling, self.model_path)
        except PoolingConfigError as e:
            self.pooling, self._pooling_error = None, str(e)
        self._structured_build = s.structured_build
        try:
            self._kv_events = startup.kv_event_publisher(self.args, s.backend.kv_event_medium)
        except BaseException:
            await asyncio.get_running_loop().run_in_executor(None, s.executor.shutdown)
            if s.kv_disk is not None:  # its I/O thread too
                self._kv_disk = self._disk_reads = None
                await asyncio.get_running_loop().run_in_executor(None, s.kv_disk.close)
            raise
        # What start-up built (torch, transformers, the model's modules) lives as long as the engine:
        # out of the collector's reach, a full collection no longer walks it while requests wait
        # (vLLM does the same).
        _freeze_startup_objects()
        s.backend.engine_started()
        self._task = asyncio.create_task(self._run(), name="aioengine-step-loop")
        config = s.config
        logger.info(
            "engine started in %.1f s: model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d "
            "(%d tokens) max_num_batched_tokens=%d max_num_seqs=%d",
            time.perf_counter() - t0,
            self.model_path,
            config.device,
            config.dtype,
            config.max_model_len,
            s.num_blocks,
            self.kv_capacity_tokens,
            config.max_num_batched_tokens,
            config.max_num_seqs,
        )
        return self

    def _device(self) -> tuple[Backend, Executor, ModelRunner]:
        """The backend, the executor and rank 0's runner (all there once start() has loaded the model)."""
        backend, executor, runner = self.backend, self._executor, self.runner
        assert backend is not None and executor is not None and runner is not None, (
            "the engine is not started"
        )
        return backend, executor, runner

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def shutdown(self) -> None:
        """Abort what is in flight, stop the step loop and the worker."""
        for state in self._outputs.live():
            self._abort_state(state)
        if self._task is not None:
            self._stopping = True
            self._wakeup.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
            _unfreeze_startup_objects()
        self._stopped.set()
        if self._disk_reads is not None:
            self._disk_reads.cancel()
        if self._kv_events is not None:
            publisher, self._kv_events = self._kv_events, None
            await asyncio.get_running_loop().run_in_executor(None, publisher.close)
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)
        if self._kv_disk is not None:  # after the worker: its last steps' writes land too
            disk, self._kv_disk = self._kv_disk, None
            await asyncio.get_running_loop().run_in_executor(None, disk.close)

    @property
    def is_running(self) -> bool:
        return self._task is not None and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def stopped(self) -> asyncio.Event:
        """Set once the engine has died or shut down (what `aioengine serve` waits on)."""
        return self._stopped

    @property
    def allow_priority(self) -> bool:
        """Whether requests may set a priority (--scheduling-policy priority)."""
        return self.args.scheduling_policy == "priority"

    def stats(self) -> EngineStats:
        s = self.scheduler
        if s is None:
            return EngineStats(0, 0, 0.0, len(self._outputs))
        stats = EngineStats(len(s.running), len(s.waiting), s.kv_cache_manager.usage, len(self._outputs))
        if not self.args.enable_lora:
            return stats
        names = self._loras.names_by_id()
        return replace(
            stats,
            running_loras=tuple(sorted({names[r.lora_id] for r in s.running if r.lora_id in names})),
            waiting_loras=tuple(sorted({names[r.lora_id] for r in s.waiting if r.lora_id in names})),
            max_loras=self.args.max_loras,
        )

    # ---- requests -----------------------------------------------------------------------------
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
    ) -> GenerateHandle:
        """Start a request; raises InvalidRequestError (bad input) or EngineDeadError at once. ``lora``: the
        name of a LoRA adapter to generate with (``lora_modules``), or None for the base model."""
        self._check_alive()
        self._lora_id(lora)  # an unknown adapter is refused before the prompt is tokenized
        params = sampling_params or SamplingParams(**self.default_sampling_params)
        prompt_text, prompt_ids = self._prompt_ids(prompt)
        return self._add(
            prompt_text, prompt_ids, params, request_id, priority, cache_salt, grammar, lora=lora
        )

    @property
    def lora_modules(self) -> dict[str, str]:
        """The LoRA adapters served beside the base model: name -> folder."""
        return self._loras.modules

    @property
    def lora_names(self) -> list[str]:
        return list(self._loras.modules)

    def _lora_id(self, lora: str | None) -> int:
        return self._loras.id_of(lora)

    @property
    def allow_lora_updates(self) -> bool:
        """Adapters may be loaded and unloaded while serving (``enable_lora_runtime_updates``)."""
        return self.args.enable_lora and self.args.enable_lora_runtime_updates

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter in folder ``path`` as ``name`` from now on; InvalidRequestError when updates
        are off, the name is taken, no slot is free or the adapter is malformed (nothing changes then)."""
        self._check_alive()
        if not self.allow_lora_updates:
            raise InvalidRequestError("loading LoRA adapters at run time needs --enable-lora-runtime-updates")
        adapter_id = self._loras.new_id(name, self.model_name)
        assert self._executor is not None
        try:
            await asyncio.wrap_future(self._executor.collective_rpc("load_lora", adapter_id, name, path))
        except LoRAError as e:
            raise InvalidRequestError(str(e), param="lora_path") from None
        self._loras.add(name, adapter_id, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; InvalidRequestError when updates are off, the name is unknown or
        requests still use it."""
        self._check_alive()
        if not self.allow_lora_updates:
            raise InvalidRequestError("unloading LoRA adapters needs --enable-lora-runtime-updates")
        adapter_id = self._lora_id(name)
        assert self.scheduler is not None and self._executor is not None
        busy = sum(r.lora_id == adapter_id for r in self.scheduler.requests.values())
        if busy:
            raise InvalidRequestError(
                f"LoRA adapter {name!r} has {busy} unfinished requests", param="lora_name"
            )
        self._loras.remove(name)  # new requests are refused from here on
        await asyncio.wrap_future(self._executor.collective_rpc("unload_lora", adapter_id))

    def _prompt_ids(self, prompt: object, param: str = "prompt") -> tuple[str | None, list[int]]:
        assert self._encode is not None
        return input_processor.prompt_ids(prompt, self._encode, self.vocab_size, self.max_model_len, param)

    def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        chat_template_kwargs: dict | None = None,
        *,
        grammar: PrecompiledGrammar | None = None,
        lora: str | None = None,
    ) -> GenerateHandle:
        self._check_alive()
        self._lora_id(lora)  # an unknown adapter is refused before the chat is rendered
        ids = self.render_chat(messages, chat_template_kwargs)
        params = sampling_params or SamplingParams(**self.default_sampling_params)
        return self._add(None, ids, params, request_id, priority, None, grammar, lora=lora)

    def render_chat(
        self, messages: list[dict], chat_template_kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The chat's prompt ids, rendered by the model's template: chat() and every server route use this."""
        return apply_chat_template(self.tokenizer, messages, **(chat_template_kwargs or {}))

    @overload
    async def embed(
        self,
        input: str | list[int],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput: ...

    @overload
    async def embed(
        self,
        input: EmbedInputs,
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]: ...

    async def embed(
        self,
        input: EmbedInput,
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput | list[EmbeddingRequestOutput]:
        """Embed a string or token ids (one output), or a list of either (a list, in order): the model's
        final hidden states pooled (``self.pooling``) and normalized, then cut to ``dimensions`` and
        renormalized if given. Prefill-only work in the same steps as generation. Raises
        InvalidRequestError, EngineDeadError, or RequestAbortedError when aborted before its vector."""
        self._check_alive()
        if self.pooling is None:
            raise InvalidRequestError(self._pooling_error, param="model")
        prompts, single = split_inputs(input)
        check_dimensions(dimensions, self.embedding_size)
        params = SamplingParams(max_tokens=1)  # nothing is sampled: it sizes the admission checks
        handles: list[GenerateHandle] = []
        try:
            for i, p in enumerate(prompts):
                text, ids = self._prompt_ids(p, "input")
                rid = request_id if single or request_id is None else f"{request_id}-{i}"
                handles.append(self._add(text, ids, params, rid, priority, None, pooling=self.pooling))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        outs = await asyncio.gather(*handles)
        results = [embedding_output(o, h.embedding, dimensions) for h, o in zip(handles, outs, strict=True)]
        return results[0] if single else results

    async def precompile(self, params: SamplingParams) -> PrecompiledGrammar | None:
        """Compile ``params``' grammar on a thread, for ``generate(..., grammar=)``: a large JSON schema
        compiles for seconds, which would stall every stream if done on the loop inside generate.
        Raises InvalidRequestError as generate would; None when ``params`` has no grammar."""
        spec = params.structured_outputs
        if spec is None:
            return None
        manager = self._structured_output_manager()
        compiling = asyncio.get_running_loop().run_in_executor(None, manager.compile, spec)
        limit = self.args.grammar_compile_timeout_s
        done, _ = await asyncio.wait((compiling,), timeout=limit)
        if not done:  # the thread cannot be stopped: it finishes on its own, and its result is dropped
            compiling.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise InvalidRequestError(
                f"The structured output's grammar did not compile within {limit:g} s "
                "(grammar_compile_timeout_s); simplify the schema.",
                param="structured_outputs",
            )
        return PrecompiledGrammar(spec, compiling.result())

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._task is None:
            raise EngineNotStartedError("call `await engine.start()` (or use `async with`) first")

    def _add(
        self,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        grammar: PrecompiledGrammar | None = None,
        pooling: str | None = None,
        lora: str | None = None,
    ) -> GenerateHandle:
        lora_id = self._lora_id(lora)
        params = input_processor.request_params(
            params,
            len(prompt_ids),
            self.max_model_len,
            self.kv_capacity_tokens,
            self.tokenizer,
            self.vocab_size,
        )
        compiled_grammar = None
        if (
            grammar is not None and grammar.spec is params.structured_outputs
        ):  # precompile()'s, for these params
            compiled_grammar = grammar.compiled
        elif params.structured_outputs is not None:  # compiled (or found in the cache) now: errors raise here
            compiled_grammar = self._structured_output_manager().compile(params.structured_outputs)
        rid = request_id if request_id is not None else f"req-{uuid.uuid4().hex}"
        if self._outputs.get(rid) is not None:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        n = params.n
        child_ids = [rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]
        state = RequestState(
            rid,
            prompt,
            prompt_ids,
            params,
            child_ids,
            [
                IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
                for _ in range(n)
            ],
            asyncio.Queue(),
            [False] * n,
            lora=lora,
        )
        self._outputs.add(state)
        assert self.scheduler is not None
        for i, cid in enumerate(child_ids):
            child_params = params
            if n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)
            request = Request(
                cid, prompt_ids, child_params, self.eos_token_id, priority, state.arrival_time, cache_salt
            )
            request.pooling = pooling
            request.lora_id = lora_id
            if compiled_grammar is not None:
                request.structured_output = self._structured.new_grammar(compiled_grammar)
            if params.thinking_token_budget is not None:  # to the scheduler a grammar, around the own one
                request.structured_output = self._structured_output_manager().thinking_budget(
                    params.thinking_token_budget, params.reasoning_parser, request.structured_output
                )
            self.scheduler.add_request(request)
        if params.timeout_s is not None:  # a no-op once the request has finished
            asyncio.get_running_loop().call_later(params.timeout_s, self._abort_state, state, "timeout")
        self._wakeup.set()
        return GenerateHandle(self, state)

    def _structured_output_manager(self) -> Any:
        if self._structured is None:
            build = self._structured_build
            try:  # done before start() returned
                manager = build.result() if build is not None else None
            except Exception:  # e.g. xgrammar missing: build again here, so the request gets the error
                manager = None
            self._structured = manager or _new_structured_output_manager(
                self.tokenizer, self.vocab_size, self.eos_token_id
            )
            assert self.scheduler is not None
            self.scheduler.structured_output_manager = self._structured
        return self._structured

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason 'abort'. False when it is not running."""
        state = self._outputs.get(request_id)
        if state is None:
            return False
        self._abort_state(state)
        return True

    def _abort_state(self, state: RequestState, reason: str = "abort") -> None:
        """End ``state`` now with finish_reason ``reason`` (abort, or timeout past its deadline); the
        scheduler frees its KV blocks."""
        live = self._outputs.unfinished(state)
        if live and self.scheduler is not None and self._dead is None:
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self._outputs.abort(state, reason)

    # ---- the step coroutine -------------------------------------------------------------------
    async def _run(self) -> None:
        self._stopped.clear()  # started (again)
        scheduler = self.scheduler
        assert scheduler is not None
        try:
            while not self._stopping:
                if not scheduler.has_requests() and not self._batch_queue:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                if not await self._step():
                    if not self._batch_queue and scheduler.waiting_on_disk:
                        self._wakeup.clear()  # a disk-tier read sets it when it lands
                        await self._wakeup.wait()
                        continue
                    await asyncio.sleep(0)  # let the loop serve others between two planned steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._die(e)
        finally:
            self._stopped.set()

    async def _step(self) -> bool:
        """Plan and enqueue step k; then, once the queue is full, await step k-1 and emit its tokens.

        Returns whether it awaited the device.
        """
        scheduler = self.scheduler
        assert scheduler is not None
        _, executor, _ = self._device()
        scheduled = False
        deferred = None
        host = self.host_s
        if scheduler.has_requests():
            t0 = time.perf_counter()
            scheduler_output = scheduler.schedule()  # stops 2-3
            host["schedule"] += time.perf_counter() - t0
            if self._disk_reads is not None:
                self._disk_reads.start()
            if scheduler_output.scheduled_new_reqs:
                self._mark_scheduled(scheduler_output.scheduled_new_reqs)
            if (
                scheduler_output.total_num_scheduled_tokens
                or scheduler_output.finished_req_ids
                or scheduler_output.preempted_req_ids
                or scheduler_output.kv_transfers is not None
            ):
                exec_fut = executor.collective_rpc(
                    "execute_model", scheduler_output
                )  # stops 4-7 (on every rank)
                scheduled = scheduler_output.total_num_scheduled_tokens > 0
                if scheduler_output.pending_structured_output_tokens and self._batch_queue:
                    # Stop 8: a structured request still has a token in flight and its bitmask needs it:
                    # sample once the previous step is processed (below). Without grammars, never.
                    deferred = (exec_fut, scheduler_output)
                else:
                    # Stop 8: the grammar bitmask (None without grammars), filled here while the forward runs.
                    bitmask = scheduler.get_grammar_bitmask(scheduler_output)
                    sample_fut = executor.collective_rpc("sample_tokens", bitmask)  # stop 9
                    self._batch_queue.appendleft((exec_fut, sample_fut, scheduler_output))
        if not self._batch_queue:
            return False
        if deferred is None and len(self._batch_queue) < 2 and scheduled and scheduler.has_requests():
            return False  # plan step k+1 before waiting for step k
        exec_fut, sample_fut, scheduler_output = self._batch_queue.pop()
        result = await self._await_step(sample_fut)  # stop 10: the only wait for the device
        if exec_fut.exception() is not None:
            raise exec_fut.exception()
        t0 = time.perf_counter()
        outputs = scheduler.update_from_output(scheduler_output, result)  # stop 11
        t1 = time.perf_counter()
        self._outputs.process(outputs, scheduler)  # stop 12: straight to each request's stream
        if self._kv_events is not None:  # the prefix cache's changes this step, to the publisher's queue
            self._kv_events.publish(
                scheduler.kv_cache_manager.block_pool.take_events(), self._loras.names_by_id()
            )
        host["update"] += t1 - t0
        host["outputs"] += time.perf_counter() - t1
        host["steps"] += 1
        if deferred is not None:  # its grammars now know every token: bitmask, then sample (stops 8-9)
            exec_fut, scheduler_output = deferred
            sample_fut = executor.collective_rpc(
                "sample_tokens", scheduler.get_grammar_bitmask(scheduler_output)
            )
            self._batch_queue.appendleft((exec_fut, sample_fut, scheduler_output))
        if self.stat_listeners:
            stats = scheduler.make_stats()
            for listener in self.stat_listeners:
                listener(stats, outputs)
        return True

    def _mark_scheduled(self, new_reqs: list[NewRequestData]) -> None:
        """The first-scheduled time of requests planned for the first time (not resumed after preemption)."""
        now = time.monotonic()
        for nr in new_reqs:
            state = self._outputs.child(nr.req_id)
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = now

    async def _await_step(self, fut: concurrent.futures.Future) -> ModelRunnerOutput:
        """The step's output, as rank 0's worker awaits it (CUDA: an event behind the device-to-host
        copy, without blocking the loop), under the watchdog; a rank's death ends it at once."""
        executor = self._executor
        assert executor is not None
        output = asyncio.ensure_future(executor.output(fut))
        # Retrieved even when this wait is cancelled (a rank's death cancels the step loop).
        output.add_done_callback(lambda f: f.cancelled() or f.exception())
        # asyncio.wait, not wait_for: wait_for can swallow a cancellation that races the result (3.11).
        done, _ = await asyncio.wait((output,), timeout=self.args.step_timeout_s)
        if not done:
            output.cancel()
            raise EngineDeadError(
                f"a step ran longer than the watchdog limit of {self.args.step_timeout_s} s"
            )
        return output.result()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache; KV events: AllBlocksCleared), only while no
        request holds a block: returns whether it did."""
        assert self.scheduler is not None, "the engine is not started"
        done = self.scheduler.kv_cache_manager.block_pool.reset_prefix_cache()
        if done and self._kv_disk is not None:
            self._kv_disk.clear()
        if done and self._kv_events is not None:
            self._kv_events.publish(self.scheduler.kv_cache_manager.block_pool.take_events(), {})
        return done

    def run_on_worker(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """Run ``fn(*args)`` on rank 0's worker, after the steps already submitted (e.g. runner stats)."""
        executor = self._executor
        assert executor is not None, "the engine is not started"
        return asyncio.wrap_future(executor.submit(fn, *args))

    def rank_stats(self) -> list[RankStats]:
        """Each tensor-parallel rank's steps and busy seconds (one entry on one device)."""
        return self._executor.rank_stats() if self._executor is not None else []

    def comm_stats(self) -> dict[str, float]:
        """Rank 0's tensor-parallel communication so far (``Executor.comm_stats``; empty on one device)."""
        return self._executor.comm_stats() if self._executor is not None else {}

    def _rank_died(self, err: EngineDeadError) -> None:
        """A tensor-parallel rank died: every request ends with ``err`` now, busy or idle."""
        if self._dead is None:
            self._die(err)
        if self._task is not None:
            self._task.cancel()

    def _die(self, exc: BaseException) -> None:
        logger.error("engine step failed; the engine is dead", exc_info=exc)
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine step failed: {exc!r}")
        if err is not exc:
            err.__cause__ = exc
        self._dead = err
        if self._executor is not None:
            self._executor.kill()  # the other ranks go with the engine (a hung one would never return)
        self._outputs.fail_all(err)
        self._batch_queue.clear()

    # ---- introspection (tests, metrics, the server) ---------------------------------------------
    def num_unfinished_requests(self) -> int:
        return len(self._outputs)

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage if self.scheduler else 0.0

    def cached_prefix_hashes(self, limit: int | None = None) -> list[int]:
        """The chained hashes of the blocks the prefix cache holds for a full-attention group (the one a
        prefix is served from whole): what a router outside the engine scores this engine by."""
        if self.scheduler is None or not self.args.enable_prefix_caching:
            return []
        kv = self.scheduler.kv_cache_manager
        full = [g for g, group in enumerate(kv.groups) if group.sliding_window is None]
        return kv.block_pool.cached_hashes(full[0] if full else 0, limit)


def _freeze_startup_objects() -> None:
    gc_freeze.freeze()  # one holder per started engine (aioengine/engine/gc_freeze.py)


def _unfreeze_startup_objects() -> None:
    gc_freeze.unfreeze()


def _new_structured_output_manager(tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    from aioengine.structured import StructuredOutputManager

    return StructuredOutputManager(tokenizer, vocab_size, eos_token_id)
