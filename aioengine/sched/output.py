"""The scheduler's plan for one step (SchedulerOutput) and what comes back from it (outputs, stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: sent in full (also a request resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]  # every known token (prompt + outputs so far for a resumed request)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit, before this step
    num_prompt_tokens: int  # the user's prompt length (penalties look at outputs only)


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    num_output_tokens: list[int] = field(default_factory=list)  # known outputs + placeholders


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str]  # likewise; they come back later as new requests
    pending_structured_output_tokens: bool = False


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, host side. sampled_token_ids[i] is empty for a prefill chunk."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # in this step
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # in this step
    num_scheduled_tokens: int = 0
