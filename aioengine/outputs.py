"""What generate() yields to users (RequestOutput, CompletionOutput) and what embed() returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability (vLLM's Logprob).

    Log-softmax of the model's raw logits after the grammar mask (vLLM's default "raw_logprobs"): before
    penalties, logit_bias, min_tokens/bad_words/allowed_token_ids masks, temperature and top-k/top-p/min-p.
    rank: 1 + the number of tokens with a strictly higher logprob.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated (or prompt) token: the chosen token first, then the top-k by rank.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # the first prompt token has none


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str  # a delta when streamed, the whole text in the final output
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None  # one dict per token in token_ids, when requested

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival, first_token and finished times (monotonic seconds)
    # When requested: one entry per prompt token (None for the first), in the first output that has tokens.
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # unit length (over the kept dimensions)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What embed() returns for one input (vLLM's EmbeddingRequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass(slots=True)
class RankStats:
    """One tensor-parallel rank's steps and the seconds its worker spent in them (rank 0 on one device)."""

    rank: int
    calls: float
    busy_s: float
