"""Scheduler: shares one token budget among running then waiting requests, with async placeholders."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aioengine.sched.kv_cache_manager import FULL, KVCacheManager
from aioengine.sched.kv_cache_spec import KVCacheGroup
from aioengine.sched.kv_offload import OffloadStats, OffloadTier
from aioengine.sched.output import (
    CachedRequestData,
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from aioengine.sched.request import (
    STOP_REASON_GRAMMAR_REJECTED,
    STOP_REASON_NO_ALLOWED_TOKENS,
    Request,
    RequestStatus,
)
from aioengine.sched.request_queue import create_request_queue
from aioengine.sched.spec_decode import (
    SpecCounters,
    SpeculativeConfig,
    can_speculate,
    propose_ngram,
    record_verdict,
)
from aioengine.sched.step_cost import PrefillCap, StepCostModel, StepFeatures

if TYPE_CHECKING:  # a type only: the manager needs xgrammar, which sched never imports
    from aioengine.structured.manager import StructuredOutputManager


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    num_blocks: int = 1024  # KV blocks, the null block included
    block_size: int = 16
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0: no cap on one prompt's share of a step
    policy: str = "fcfs"  # or "priority"
    kv_cache_groups: tuple[KVCacheGroup, ...] = FULL  # one full-attention group unless the model has windows
    speculative: SpeculativeConfig | None = None  # n-gram drafts verified inside the token budget
    # ITL-aware budget: a step's prompt chunks are cut so that its predicted duration (step_cost.py, fitted
    # to measured steps) stays within this; 0: no target (the token budget alone, as before).
    target_itl_ms: float = 0.0
    # ...or within this many times the predicted duration of the step's decodes alone (0: none; with both, the
    # larger limit holds).
    target_itl_ratio: float = 0.0
    kv_events: bool = False  # the block pool records its changes for the KV-event publisher
    max_loras: int = 0  # LoRA adapters that may run at once (the worker's slots); 0: no limit
    kv_offload_slots: int = 0  # host-tier slots for blocks the pool evicts (0: no second tier)
    # With a disk tier: the keys its block files hold (a restart finds them); None: no disk tier.
    kv_offload_disk_index: list[tuple[int, int]] | None = None
    kv_offload_disk_blocks: int = 0  # the most block files the disk tier keeps (0: no cap)

    def __post_init__(self) -> None:
        assert self.max_num_batched_tokens >= 1 and self.max_num_seqs >= 1 and self.block_size >= 1
        assert self.long_prefill_token_threshold >= 0 and self.target_itl_ms >= 0
        assert self.target_itl_ratio == 0 or self.target_itl_ratio > 1


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.max_model_len,
            config.enable_prefix_caching,
            config.kv_cache_groups,
            config.kv_events,
            OffloadTier(
                config.kv_offload_slots,
                config.kv_offload_disk_index,
                config.block_size,
                config.kv_offload_disk_blocks,
            )
            if config.kv_offload_slots
            else None,
        )
        self._offload_stats = OffloadStats()  # the totals at the last stats
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        # Steps scheduled and not yet updated: id(SchedulerOutput) -> (it, its request ids' Request objects).
        self._in_flight: dict[int, tuple[SchedulerOutput, dict[str, Request]]] = {}
        self.num_preemptions_total = 0
        self._num_preemptions_step = 0
        self._num_scheduled_tokens_since_stats = 0
        self._spec = SpecCounters()  # since the last stats
        self.spec_totals = SpecCounters()  # since start
        # Fills grammar bitmasks (aioengine.structured.StructuredOutputManager); set by the engine.
        self.structured_output_manager: StructuredOutputManager | None = None
        # Fitted to every step's measured duration when there is a target to meet.
        self.step_cost = StepCostModel() if config.target_itl_ms > 0 or config.target_itl_ratio > 0 else None
        self.prefill_caps = 0  # steps whose prompt chunks the target cut (stats)

    # ---- request lifecycle --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        assert 0 < request.num_tokens < self.max_model_len, "the engine validates prompt lengths"
        self.requests[request.request_id] = request
        request.can_speculate = (
            self.config.speculative is not None
            and request.pooling is None
            and can_speculate(request.sampling_params)
        )
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string): free their blocks at once.

        A request whose step is in flight is skipped by the update of that step.
        """
        assert status.is_finished
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            done.append(request)
        return done

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.kv_cache_manager.release_disk_reads(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    @property
    def waiting_on_disk(self) -> bool:
        """Some request waits for disk-tier reads (the engine wakes the step loop when they land)."""
        offload = self.kv_cache_manager.offload
        return offload is not None and offload.waiting_on_disk

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # ---- schedule -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        threshold = cfg.long_prefill_token_threshold
        max_model_len = self.max_model_len
        token_budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, tuple[list[int], ...]] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []
        spec = cfg.speculative
        if spec is not None and len(self.running) > spec.disable_by_batch_size:
            spec = None
        drafts: dict[str, list[int]] = {}
        to_propose: dict[str, int] = {}
        step = self._decode_features()  # the step's predicted work, prompt chunks added as they are planned
        prefill_cap = PrefillCap(
            self.step_cost, cfg.target_itl_ms / 1e3, cfg.target_itl_ratio, cfg.block_size, step
        )

        # Running pass, from the front: decodes that came first get their token before later prefills.
        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            if request.num_drafts_in_flight or request.proposing:
                i += 1  # how many of its drafts hold decides where it goes on: wait for the verdict
                continue
            if self._all_in_flight(request):
                i += 1  # no extra step
                continue
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids)
            need = num_tokens + placeholders - request.num_computed_tokens
            if 0 < threshold < need:
                need = threshold
            need = min(need, token_budget, max_model_len - request.num_computed_tokens)
            is_chunk = need > 1 or request.num_computed_tokens < request.num_prompt_tokens
            if is_chunk:
                need = prefill_cap.limit(need, request.num_computed_tokens)
            if need <= 0:
                i += 1
                continue
            proposal: list[int] = []
            lookahead = 0
            if (
                spec is not None
                and request.can_speculate
                and need == num_tokens + placeholders - request.num_computed_tokens == 1
            ):
                proposal, lookahead = self._propose(request, spec, token_budget - need)
                need += len(proposal)
            while True:
                blocks = kv.allocate_slots(request, need, num_lookahead_tokens=lookahead)
                if blocks is not None:
                    break
                if proposal or lookahead:  # drafts are optional: drop them before preempting anyone
                    need -= len(proposal)
                    proposal, lookahead = [], 0
                    continue
                victim = self._pick_victim()
                j = running.index(victim) if victim is not running[-1] else len(running) - 1
                del running[j]
                if j < i:
                    i -= 1
                if victim.request_id in num_scheduled:  # priority policy: undo its place in this step
                    token_budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    drafts.pop(victim.request_id, None)
                    to_propose.pop(victim.request_id, None)
                    scheduled_running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                continue  # the request itself was preempted; running[i] is now the next one
            scheduled_running.append(request)
            num_scheduled[request.request_id] = need
            if is_chunk:
                prefill_cap.planned(need, request.num_computed_tokens)
            if proposal:
                drafts[request.request_id] = proposal
            if lookahead:
                to_propose[request.request_id] = lookahead
            if any(blocks):
                new_block_ids[request.request_id] = tuple([b.block_id for b in g] for g in blocks)
            token_budget -= need
            i += 1

        # Waiting pass: admit new (or preempted) requests while budget, sequences and blocks remain.
        if not preempted:
            skipped: list[Request] = []
            waiting = self.waiting
            loras = {r.lora_id for r in running if r.lora_id}  # adapters holding the worker's slots
            while len(waiting) and token_budget > 0 and len(running) < cfg.max_num_seqs:
                request = waiting.peek()
                if request.num_output_placeholders:
                    # Preempted with a token still in flight: resume once it has arrived.
                    skipped.append(waiting.pop())
                    continue
                if (
                    cfg.max_loras
                    and request.lora_id
                    and request.lora_id not in loras
                    and len(loras) >= cfg.max_loras
                ):
                    # vLLM's rule: no more adapters at once than slots; it waits for one to go idle
                    skipped.append(waiting.pop())
                    continue
                if request.sampling_params.prompt_logprobs is None and request.pooling in (None, "last"):
                    hit_blocks, num_hit = kv.get_computed_blocks(request)
                    if kv.read_from_disk(request, num_hit):
                        skipped.append(waiting.pop())  # the disk tier's blocks are on their way
                        continue
                else:  # prompt logprobs, mean and CLS pooling need every prompt position: no cache reads
                    hit_blocks, num_hit = [], 0
                need = request.num_tokens - num_hit
                if 0 < threshold < need:
                    need = threshold
                need = prefill_cap.limit(min(need, token_budget), num_hit)
                if need <= 0:
                    break  # the step's time is spent: the next one admits it
                blocks = kv.allocate_slots(request, need, num_hit, hit_blocks)
                if blocks is None:
                    break
                waiting.pop()
                kv.release_disk_reads(request)
                kv.record_prefix_hit(request, num_hit)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                running.append(request)
                if request.lora_id:
                    loras.add(request.lora_id)
                scheduled_new.append(request)
                num_scheduled[request.request_id] = need
                prefill_cap.planned(need, num_hit)
                token_budget -= need
            for request in reversed(skipped):
                waiting.prepend(request)

        # Build the output before the counters advance (the runner needs the values before this step).
        new_reqs = [
            NewRequestData(
                r.request_id,
                list(r.all_token_ids),
                r.sampling_params,
                kv.get_block_ids(r.request_id),
                r.num_computed_tokens,
                r.num_prompt_tokens,
                r.eos_token_id,
                r.pooling,
                r.lora_id,
            )
            for r in scheduled_new
        ]
        cached = CachedRequestData(
            req_ids=[r.request_id for r in scheduled_running],
            new_block_ids=[new_block_ids.get(r.request_id) for r in scheduled_running],
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
            num_output_tokens=[r.num_output_tokens + r.num_output_placeholders for r in scheduled_running],
        )
        total = cfg.max_num_batched_tokens - token_budget
        assert total == sum(num_scheduled.values()) and total <= cfg.max_num_batched_tokens
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=drafts,
            num_drafts_to_propose=to_propose,
            step_features=step if self.step_cost is not None else None,
            kv_transfers=kv.offload.take_transfers() if kv.offload is not None else None,
        )
        if num_scheduled:  # which Request each of the step's ids meant (update_from_output checks it)
            self._in_flight[id(out)] = (out, {rid: self.requests[rid] for rid in num_scheduled})
        self.prefill_caps += prefill_cap.cut
        self.finished_req_ids = set()
        self._num_preemptions_step += len(preempted)
        self._num_scheduled_tokens_since_stats += total
        self._update_after_schedule(out)
        return out

    def _all_in_flight(self, request: Request) -> bool:
        """Every token the request may still get is already in flight (async placeholders)."""
        placeholders = request.num_output_placeholders
        num_tokens = len(request.all_token_ids)
        return bool(placeholders) and (
            num_tokens - request.num_prompt_tokens + placeholders >= request.max_tokens
            or num_tokens + placeholders >= self.max_model_len
        )

    def _decode_features(self) -> StepFeatures:
        """The decodes the running requests will add to this step (before any prompt chunk is planned)."""
        step = StepFeatures()
        if self.step_cost is None:
            return step
        for r in self.running:  # the running pass's own skips, so the prediction counts the rows it plans
            if r.num_drafts_in_flight or r.proposing or self._all_in_flight(r):
                continue
            left = len(r.all_token_ids) + r.num_output_placeholders - r.num_computed_tokens
            if left == 1 and r.num_computed_tokens >= r.num_prompt_tokens:  # a prompt's last token: a chunk
                step.decode_rows += 1
                step.decode_context += r.num_computed_tokens + 1
        return step

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        requests = self.requests
        for req_id, n in out.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders
            )
            if request.is_prefill_chunk or request.pooling is not None:
                continue  # (an embedding's last chunk: its vector is in flight, nothing is sampled)
            request.draft_token_ids = []  # used by this step, or stale after it
            request.proposing = req_id in out.num_drafts_to_propose
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if num_drafts:  # the sampled token and up to num_drafts accepted drafts are in flight
                request.num_output_placeholders += 1 + num_drafts
                request.num_drafts_in_flight = num_drafts
                continue
            if request.structured_output is not None:
                out.structured_output_request_ids.append(req_id)
                # Its bitmask needs the token still in flight: sampling waits for that step (stop 8).
                out.pending_structured_output_tokens |= request.num_output_placeholders > 0
            request.num_output_placeholders += 1  # its sampled token is in flight from now on

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """Stop 8: the bitmask of every structured request that samples in this step (None when none).

        Call it once every token those requests have in flight has been applied by update_from_output.
        """
        ids = scheduler_output.structured_output_request_ids
        if not ids or self.structured_output_manager is None:
            return None
        requests = self.requests
        live = [rid for rid in ids if rid in requests]  # some may have finished since
        if not live:
            return None
        grammars = []
        for rid in live:
            grammar = requests[rid].structured_output
            assert grammar is not None  # only structured requests are listed
            grammars.append(grammar)
        return self.structured_output_manager.grammar_bitmask(live, grammars)

    def _propose(self, request: Request, spec: SpeculativeConfig, budget: int) -> tuple[list[int], int]:
        """Drafts for a decode of one token, within the token budget, max_tokens and max_model_len; and for
        a draft model, how many proposals to ask of this step (for the next one)."""
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            return [], 0  # its stop tokens are masked until then: one position at a time
        if request.spec_pause:
            request.spec_pause -= 1  # its drafts kept failing: decode plainly for a while
            return [], 0
        placeholders = request.num_output_placeholders
        left = (
            min(
                request.max_tokens - request.num_output_tokens,
                self.max_model_len - request.num_tokens,
            )
            - placeholders
        )
        # the step's own token comes on top of the drafts
        if not spec.uses_draft_model:
            return propose_ngram(request.all_token_ids, spec, min(budget, left - 1), placeholders), 0
        # Proposals made after the request's last known token; with a token in flight they are stale.
        drafts = request.draft_token_ids[: max(0, min(budget, left - 1))] if not placeholders else []
        # after this step's 1 + len(drafts) tokens, the next step's own token comes on top of its drafts
        return drafts, max(0, min(spec.num_speculative_tokens, left - len(drafts) - 2))

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the blocks, keep every token, go back to the front of waiting."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.is_prefill_chunk = False
        request.draft_token_ids = []
        self.num_preemptions_total += 1
        self.waiting.prepend(request)

    # ---- update -------------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a finished step: append tokens, drop placeholders, check stops; output only what changed."""
        outputs: list[EngineCoreOutput] = []
        requests = self.requests
        kv = self.kv_cache_manager
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_cached_block = kv.num_cached_block
        block_size = kv.block_size
        proposed = runner_output.draft_token_ids
        cost, features = self.step_cost, scheduler_output.step_features
        if cost is not None and features is not None and runner_output.step_time_s is not None:
            cost.observe(features, runner_output.step_time_s)  # the fit follows the measured steps
        if runner_output.pooler_output:
            outputs.extend(self._finish_pooled(runner_output.pooler_output))
        _, planned = self._in_flight.pop(id(scheduler_output), (None, {}))
        if scheduler_output.kv_transfers is not None and kv.offload is not None:
            kv.offload.written(scheduler_output.kv_transfers)
        for i, req_id in enumerate(runner_output.req_ids):
            new_token_ids = sampled[i]
            if not new_token_ids:
                continue  # a prefill chunk (or an embedding) produces no token
            request = requests.get(req_id)
            if request is None or planned.get(req_id, request) is not request:
                # finished (aborted, stopped) while this step was in flight, maybe with its id taken since
                # by a new request, which this step's token is not for
                continue
            if req_id in scheduler_output.num_drafts_to_propose:
                request.proposing = False
                request.draft_token_ids = proposed[i] if proposed is not None else []
            num_drafts = len(drafts.get(req_id, ()))  # of this step (an earlier one may still be landing)
            if num_drafts:
                self._spec.record(num_drafts, len(new_token_ids) - 1)
                self.spec_totals.record(num_drafts, len(new_token_ids) - 1)
                record_verdict(request, len(new_token_ids) - 1)
                request.num_drafts_in_flight = 0
                request.num_output_placeholders -= 1 + num_drafts
                if request.status == RequestStatus.RUNNING:  # (a preempted one recomputes from 0)
                    # rejected drafts' KV is stale: those slots are written again by the next step
                    request.num_computed_tokens -= num_drafts + 1 - len(new_token_ids)
            else:
                request.num_output_placeholders -= len(new_token_ids)
            assert request.num_output_placeholders >= 0
            status = None
            grammar = request.structured_output
            for n, token in enumerate(new_token_ids, 1):
                if token < 0 or (grammar is not None and not grammar.accept_token(token)):
                    # No token was allowed (a dead end), or the grammar refused this one: finish, never hang.
                    request.stop_reason = (
                        STOP_REASON_NO_ALLOWED_TOKENS if token < 0 else STOP_REASON_GRAMMAR_REJECTED
                    )
                    status = RequestStatus.FINISHED_ERROR
                    del new_token_ids[n - 1 :]
                    break
                request.all_token_ids.append(token)
                status = self._check_stop(request, token)
                if status is None and grammar is not None and grammar.is_terminated():
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (e.g. with ignore_eos)
                if status is not None:
                    del new_token_ids[n:]
                    break
            if status is not None:
                request.status = status
                if request in self.running:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._free_request(request)
            elif request.num_computed_tokens // block_size > min(num_cached_block.get(req_id, (1 << 62,))):
                kv.cache_blocks(request, request.num_computed_tokens)  # a block just filled up
            out = EngineCoreOutput(
                req_id,
                new_token_ids,
                status.finish_reason if status else None,
                request.stop_reason,
                max(request.num_cached_tokens, 0),
            )
            sampled_logprobs = logprobs[i] if logprobs is not None else None
            if sampled_logprobs is not None:
                out.new_logprobs = sampled_logprobs[: len(new_token_ids)]
            if prompt_logprobs:
                out.new_prompt_logprobs = prompt_logprobs.get(req_id)
            outputs.append(out)
        return outputs

    def _finish_pooled(self, pooled: dict[str, object]) -> list[EngineCoreOutput]:
        """Embedding requests whose prompt completed: finished, their vectors out with the finish."""
        outputs = []
        for req_id, vector in pooled.items():
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while its last step was in flight
            # (preempted meanwhile: its vector is whole all the same, so it finishes from waiting)
            (self.running if request in self.running else self.waiting).remove(request)
            request.status = RequestStatus.FINISHED_STOPPED
            self._free_request(request)  # (its prompt's full blocks were cached when allocated)
            out = EngineCoreOutput(req_id, [], "stop", None, max(request.num_cached_tokens, 0))
            out.pooling_output = vector
            outputs.append(out)
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ---- stats --------------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """Stats of the steps since the last call (prefix-cache and preemption counts are deltas)."""
        pc = self.kv_cache_manager.take_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            num_preemptions=self._num_preemptions_step,
            num_scheduled_tokens=self._num_scheduled_tokens_since_stats,
        )
        self._spec.take(stats)
        offload = self.kv_cache_manager.offload
        if offload is not None:
            now, last = offload.stats, self._offload_stats
            stats.kv_offload_stored_blocks = now.stored_blocks - last.stored_blocks
            stats.kv_offload_host_hits = now.host_hit_tokens - last.host_hit_tokens
            stats.kv_offload_disk_reads = now.disk_read_blocks - last.disk_read_blocks
            stats.kv_offload_disk_failures = now.disk_reads_failed - last.disk_reads_failed
            self._offload_stats = dataclasses.replace(now)
        self._num_preemptions_step = 0
        self._num_scheduled_tokens_since_stats = 0
        return stats
