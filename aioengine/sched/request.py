"""Request: one sequence's tokens, counters and status as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aioengine.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: importing it would pull numpy into sched
    from aioengine.structured.budget import ThinkingBudget
    from aioengine.structured.manager import Grammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# stop_reason of a request finished with FINISHED_ERROR by its sampling constraints (finish_reason "error").
STOP_REASON_NO_ALLOWED_TOKENS = "no_allowed_tokens"  # grammar, min_tokens, bad words... left no token
STOP_REASON_GRAMMAR_REJECTED = "grammar_rejected_token"  # the grammar refused a sampled token (a bug guard)

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    lora_id: int = (
        0  # the LoRA adapter (0: the base model; never reused); prefix-cache blocks are keyed by it
    )
    # An embedding request (aioengine/model/pooling.py's types): prefill-only, finished by the runner's pooled
    # vector instead of a sampled token.
    pooling: str | None = None

    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0  # sampled tokens still in flight (async scheduling)
    is_prefill_chunk: bool = False
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission
    kv_disk_rounds: int = 0  # lookups that started disk-tier reads for it (it waits for them)
    kv_disk_keys: list[tuple[int, int]] = field(default_factory=list)  # the blocks it had read from disk
    block_hashes: list[int] = field(
        default_factory=list
    )  # chained hashes of the full blocks of all_token_ids
    # Structured output: the grammar state (aioengine.structured.Grammar, or a thinking budget around it),
    # advanced as tokens arrive.
    structured_output: Grammar | ThinkingBudget | None = None
    max_tokens: int = field(init=False)
    # Speculative decoding: whether its sampling allows it (spec_decode.can_speculate), and the drafts of
    # the step in flight (its next step waits for their verdict).
    can_speculate: bool = False
    num_drafts_in_flight: int = 0
    # A draft model's proposals: asked of the step in flight (its next step waits for them), then kept for
    # the step after it.
    proposing: bool = False
    draft_token_ids: list[int] = field(default_factory=list)
    spec_accepted_ema: float = 1.0  # accepted drafts per verified step, smoothed (spec_decode.py's policy)
    spec_pause: int = 0  # decode steps left without proposals

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        mt = self.sampling_params.max_tokens
        self.max_tokens = mt if mt is not None else 1 << 62

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED
