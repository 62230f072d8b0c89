"""Speculative decoding's per-request policy (its config is config.SpeculativeConfig), and the
n-gram proposer: drafts copied from where the request's last tokens occurred before in its own context
(prompt lookup). A draft model's proposals come from the runner (aioengine/gpu/drafter.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.config import SpeculativeConfig
from aioengine.sampling_params import SamplingParams
from aioengine.sched.output import SchedulerStats
from aioengine.sched.request import Request

# A verified step costs more than a decode on a CPU (docs/benchmarks.md): a request whose drafts keep
# failing stops proposing for a while, then tries again.
_EMA = 0.25  # weight of the newest verdict
POOR_ACCEPTANCE = 0.3  # accepted drafts per verified step, smoothed, below which proposals pause
PAUSE_STEPS = 16


def record_verdict(request: Request, num_accepted: int) -> None:
    """Fold one verified step's accepted drafts into the request's acceptance, pausing it when poor."""
    ema = (1 - _EMA) * request.spec_accepted_ema + _EMA * num_accepted
    if ema < POOR_ACCEPTANCE:
        request.spec_pause, ema = PAUSE_STEPS, 1.0  # after the pause it gets a fresh chance
    request.spec_accepted_ema = ema


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's sampling allows verifying several positions in one step.

    The positions of a verified draft share one row's sampling state, so what depends on the tokens before
    each position opts out: penalties, multi-token bad words and grammars. min_tokens opts out until it is
    reached (the scheduler checks that). Logprobs do not: each position's row gives its token's.
    """
    return not (
        params.speculative is False
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.bad_words
        or params.structured_outputs is not None
        or params.thinking_token_budget is not None  # its closing tag is forced token by token, as a grammar
    )


def propose_ngram(tokens: list[int], config: SpeculativeConfig, max_drafts: int, skip: int = 0) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the context's last n tokens, for the
    longest n in [prompt_lookup_min, prompt_lookup_max] that occurs; at most ``max_drafts`` of them.

    ``skip``: tokens already in flight after ``tokens`` (async scheduling): the drafts start past the
    continuation's first ``skip`` tokens, taken as the prediction of the ones in flight.
    """
    k = min(config.num_speculative_tokens, max_drafts)
    num = len(tokens)
    if k <= 0:
        return []
    for n in range(min(config.prompt_lookup_max, num - 1), config.prompt_lookup_min - 1, -1):
        suffix = tokens[num - n :]
        first = suffix[0]
        # Search backwards: the most recent match continues the current passage most often.
        i = num - n - 1
        while i >= 0:
            try:
                i = _rindex(tokens, first, i)
            except ValueError:
                break
            if tokens[i : i + n] == suffix:
                return tokens[i + n + skip : i + n + skip + k]
            i -= 1
    return []


def _rindex(tokens: list[int], value: int, end: int) -> int:
    """The last index <= end holding value (ValueError when none)."""
    for i in range(end, -1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)


@dataclass(slots=True)
class SpecCounters:
    """Draft verdicts since the last stats."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def take(self, stats: SchedulerStats) -> None:
        stats.spec_num_drafts, stats.spec_num_draft_tokens = self.num_drafts, self.num_draft_tokens
        stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = (
            self.num_accepted_tokens,
            self.accepted_per_pos,
        )
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = []
