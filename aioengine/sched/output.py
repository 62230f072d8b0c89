"""The scheduler's plan for one step (SchedulerOutput) and what comes back from it (outputs, stats)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aioengine.sampling_params import SamplingParams

if TYPE_CHECKING:  # types only: sched never imports numpy (or torch) at run time
    import numpy as np
    import numpy.typing as npt

    from aioengine.sched.kv_offload import KVTransfers
    from aioengine.sched.step_cost import StepFeatures

# The logprobs of one position: (token ids, logprobs, rank of the first id). The first id is the sampled (or
# prompt) token, the rest are the top-k by rank. Plain lists: the scheduler never sees tensors.
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: sent in full (also a request resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]  # every known token (prompt + outputs so far for a resumed request)
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per KV cache group
    num_computed_tokens: int  # prefix-cache hit, before this step
    num_prompt_tokens: int  # the user's prompt length (penalties look at outputs only)
    eos_token_id: int | None = None  # masked with stop_token_ids until min_tokens (unless ignore_eos)
    pooling: str | None = None  # an embedding request: pool its prompt's hidden states, sample nothing
    lora_id: int = 0  # its LoRA adapter (0: none)


@dataclass(slots=True)
class CachedRequestData:
    """Diffs for requests the runner already holds, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)  # per KV cache group
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
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify
    # Draft-model proposals to make after this step's sampling: request -> at most this many drafts (their
    # KV slots are reserved past the scheduled tokens).
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)
    # The step's work in the cost model's terms, with an ITL target (its measured time refines the fit).
    step_features: StepFeatures | None = None
    pending_structured_output_tokens: bool = False  # a structured request samples with a token in flight
    structured_output_request_ids: list[str] = field(default_factory=list)  # structured requests that sample
    kv_transfers: KVTransfers | None = None  # the offload tier's copies, before the forward


@dataclass(slots=True)
class GrammarOutput:
    """Stop 8: the allowed-token bitmask of each structured request that samples in a step.

    bitmask: int32 [len(req_ids), ceil(vocab / 32)], bit j of word w allows token 32 * w + j.
    """

    req_ids: list[str]
    bitmask: npt.NDArray[np.int32]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, host side. sampled_token_ids[i] is empty for a prefill chunk."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # a negative id: no token was allowed (a dead end)
    logprobs: list[list[TokenLogprobs] | None] | None = None  # per request, one per sampled token
    prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None  # whole prompt, with the first token
    draft_token_ids: list[list[int]] | None = None  # per request: the draft model's proposals, if asked
    # Embedding requests whose prompt completed in this step: their pooled, normalized vectors (numpy).
    pooler_output: dict[str, Any] | None = None
    step_time_s: float | None = None  # the worker's busy time for this step (prepare, forward, sample)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, when requested
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    pooling_output: Any = None  # an embedding request's vector (numpy float32), with its finish

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
    num_scheduled_tokens: int = 0  # planned since the previous stats
    # Speculative decoding, since the previous stats (vLLM's spec-decode counters).
    spec_num_drafts: int = 0  # requests' draft runs verified
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # accepted drafts at position 0, 1, ...
    # The KV offload tier, since the previous stats (sched/kv_offload.py's OffloadStats).
    kv_offload_stored_blocks: int = 0
    kv_offload_host_hits: int = 0  # tokens loaded back from the host tier (disk reads land there first)
    kv_offload_disk_reads: int = 0  # blocks read back from disk (one per KV cache group)
    kv_offload_disk_failures: int = 0  # block files found bad and recomputed
