"""SamplingParams: how one request samples and when it stops, validated with vLLM's messages."""

from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.errors import InvalidRequestError

MAX_LOGPROBS = 20
_SAMPLING_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        for name in ("n", "top_k", "min_tokens"):
            if type(getattr(self, name)) is not int:
                raise bad(name, f"{name} must be an integer, got {getattr(self, name)!r}.")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
                raise bad(name, f"{name} must be a number, got {value!r}.")
        if self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}.")
        if self.temperature < 0.0:
            raise bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty",
                      f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty",
                      f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.max_tokens is not None:
            if type(self.max_tokens) is not int:
                raise bad("max_tokens", f"max_tokens must be an integer, got {self.max_tokens!r}.")
            if self.max_tokens < 1:
                raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                    f"got {self.min_tokens}.")
        if self.seed is not None and (type(self.seed) is not int or not -(2**63) <= self.seed < 2**63):
            raise bad("seed", f"seed must be a 64-bit integer, got {self.seed!r}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "stop must be a string or a list of strings.")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop cannot contain an empty string.")
        if not all(type(t) is int and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers.")
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}.")
        if self.n > 1 and self.greedy:
            raise bad("n", f"n must be 1 when using greedy sampling, got {self.n}.")
