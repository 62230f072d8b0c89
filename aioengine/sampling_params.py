"""SamplingParams: how one request samples and when it stops, validated with vLLM's messages."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aioengine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# The think-block rules a reasoning model follows (aioengine/http/reasoning.py splits by them): qwen3's
# output opens a <think> block (or none); deepseek_r1's template opens it in the prompt, so the output starts
# inside it.
REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"  # the block's tags, in both
_FLOAT32_MAX = 3.4028234663852886e38
_INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 100.0
_SAMPLING_EPS = 1e-5


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric field's bounds (inclusive unless exclusive_lo) and vLLM's wording for them."""

    lo: float | None = None
    hi: float | None = None
    exclusive_lo: bool = False
    words: str = ""  # "{name} must be {words}, got {value}."
    above: str | None = None  # the words for a value past hi, where they differ

    def problem(self, value: float) -> str | None:
        """What is wrong with value ("must be ..."), or None when it is within the bounds."""
        if self.lo is not None and (value <= self.lo if self.exclusive_lo else value < self.lo):
            return self.words
        if self.hi is not None and value > self.hi:
            return self.above or self.words
        return None


# The one statement of the sampling bounds: SamplingParams checks them, and the HTTP request tables
# (http/request_fields.py) state them in /openapi.json from here.
BOUNDS: dict[str, Range] = {
    "n": Range(lo=1, words="at least 1"),
    "temperature": Range(lo=0, words="non-negative"),
    "top_p": Range(lo=0, hi=1, exclusive_lo=True, words="in (0, 1]"),
    "top_k": Range(
        lo=-1, hi=_INT32_MAX, words="0 or -1 (disable), or at least 1", above=f"at most {_INT32_MAX}"
    ),
    "min_p": Range(lo=0, hi=1, words="in [0, 1]"),
    "presence_penalty": Range(lo=-2, hi=2, words="in [-2, 2]"),
    "frequency_penalty": Range(lo=-2, hi=2, words="in [-2, 2]"),
    "repetition_penalty": Range(lo=0, exclusive_lo=True, words="greater than zero"),
    "max_tokens": Range(lo=1, words="at least 1"),
    # kept as 64-bit ints on the device: a bigger int kills the step that stores it
    "min_tokens": Range(
        lo=0, hi=_INT32_MAX, words="greater than or equal to 0", above=f"at most {_INT32_MAX}"
    ),
    "seed": Range(lo=-(2**63), hi=2**63 - 1, words="a 64-bit integer"),
    "logprobs": Range(lo=0, hi=MAX_LOGPROBS, words="non-negative"),
    "prompt_logprobs": Range(lo=0, hi=MAX_LOGPROBS, words="non-negative"),
    "timeout_s": Range(lo=0, exclusive_lo=True, words="greater than zero"),
    "thinking_token_budget": Range(
        lo=0, hi=_INT32_MAX, words="greater than or equal to 0", above=f"at most {_INT32_MAX}"
    ),
}


@dataclass(slots=True)
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's names): exactly one of the first five fields is set.

    json: a JSON schema (dict or JSON text); regex: a regular expression; choice: the output is one of these
    strings; grammar: an EBNF grammar (GBNF/xgrammar syntax, root rule `root`); json_object: any JSON
    object (compact).
    disable_any_whitespace: JSON without free whitespace between tokens (fewer ways for small models to loop).
    reasoning: a reasoning parser's kind ("qwen3", "deepseek_r1"): its think block comes first, unconstrained,
    and the constraint covers the answer after it (vLLM's default with a reasoning parser). None: the
    constraint covers the whole output.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning: str | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) > 1:
            raise InvalidRequestError(
                f"You can only use one kind of structured outputs constraint but multiple are specified: "
                f"{kinds}",
                param="structured_outputs",
            )
        if not kinds:
            raise InvalidRequestError(
                "You must use one kind of structured outputs constraint but none are specified.",
                param="structured_outputs",
            )
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError("choice must be a list of strings.", param="structured_outputs")
            if not self.choice:
                raise InvalidRequestError(
                    f"Choice '{list(self.choice)}' cannot be an empty list", param="structured_outputs"
                )
            self.choice = list(self.choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise InvalidRequestError(
                "structured_outputs.grammar cannot be an empty string", param="structured_outputs"
            )
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError("structured_outputs.regex must be a string", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, str | dict | bool):
            raise InvalidRequestError(
                "structured_outputs.json must be a JSON schema (an object or JSON text)",
                param="structured_outputs",
            )

    def kinds(self) -> list[str]:
        return [
            k
            for k in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, k) not in (None, False)
        ]

    def cache_key(self) -> tuple[str, str]:
        """(kind, spec): equal keys compile to the same grammar."""
        kind, spec = self._kind_key()
        return (kind if self.reasoning is None else f"{kind}+{self.reasoning}", spec)

    def _kind_key(self) -> tuple[str, str]:
        kind = self.kinds()[0]
        if kind == "json":
            spec = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return (f"json:{int(self.disable_any_whitespace)}", spec)
        if kind == "choice":
            return ("choice", json.dumps(self.choice))
        if kind == "json_object":
            return ("json_object", "")
        return (kind, getattr(self, kind))


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
    logprobs: int | None = None  # sampled token's logprob plus this many top logprobs (0: sampled only)
    prompt_logprobs: int | None = None  # per prompt token: its logprob plus this many top logprobs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    bad_words: list[str] | None = None  # never generate these words (each as token sequences, see below)
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True  # False: this request never verifies drafts (when the engine speculates)
    # A deadline, in seconds from generate(): then the request ends with finish_reason "timeout" (what it
    # generated so far is kept) and its KV blocks are freed.
    timeout_s: float | None = None
    # At most this many tokens inside the think block: then the engine forces "</think>" and the answer
    # follows (vLLM's thinking_token_budget, Anthropic's thinking.budget_tokens). The block follows
    # reasoning_parser's rules (REASONING_PARSERS; None: qwen3's, the block opens with "<think>").
    thinking_token_budget: int | None = None
    reasoning_parser: str | None = None
    # Filled by the engine from bad_words with its tokenizer (vLLM's _bad_words_token_ids).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise InvalidRequestError(
                    f"Invalid structured_outputs: {e}", param="structured_outputs"
                ) from None
        if self.logit_bias is not None:
            self.logit_bias = _clamped_logit_bias(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
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

        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "speculative"):
            if type(getattr(self, name)) is not bool:
                raise bad(name, f"{name} must be a boolean, got {getattr(self, name)!r}.")
        for name in ("n", "top_k", "min_tokens"):
            if type(getattr(self, name)) is not int:
                raise bad(name, f"{name} must be an integer, got {getattr(self, name)!r}.")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
                raise bad(name, f"{name} must be a number, got {value!r}.")
            if abs(value) > _FLOAT32_MAX:  # the device keeps them as float32: beyond, they would become inf
                raise bad(name, f"{name} must be a finite float32, got {value!r}.")
        if self.thinking_token_budget is not None and type(self.thinking_token_budget) is not int:
            raise bad(
                "thinking_token_budget",
                f"thinking_token_budget must be an integer, got {self.thinking_token_budget!r}.",
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise bad(
                "reasoning_parser",
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}.",
            )
        if self.timeout_s is not None:
            t = self.timeout_s
            if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0 or t == float("inf"):
                raise bad("timeout_s", f"timeout_s must be a finite number of seconds > 0, got {t!r}.")
        if self.max_tokens is not None and type(self.max_tokens) is not int:
            raise bad("max_tokens", f"max_tokens must be an integer, got {self.max_tokens!r}.")
        if self.seed is not None and type(self.seed) is not int:
            raise bad("seed", f"seed must be a 64-bit integer, got {self.seed!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                raise bad(name, f"{name} must be an integer, got {value!r}.")
            if value is not None and value > MAX_LOGPROBS:
                what = "sample" if name == "logprobs" else "prompt"
                raise bad(
                    name,
                    f"Requested {what} logprobs of {value}, which is greater than max allowed: "
                    f"{MAX_LOGPROBS}",
                )
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            problem = None if value is None else bounds.problem(value)
            if problem is not None:
                raise bad(name, f"{name} must be {problem}, got {value}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
            )
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise bad("stop", "stop must be a string or a list of strings.")
        if any(s == "" for s in self.stop):
            raise bad("stop", "stop cannot contain an empty string.")
        if not isinstance(self.stop_token_ids, list | tuple) or not all(
            type(t) is int and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers.")
        if self.n > 1 and self.greedy:
            raise bad("n", f"n must be 1 when using greedy sampling, got {self.n}.")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list | tuple) or not all(
                type(t) is int for t in self.allowed_token_ids
            ):
                raise bad("allowed_token_ids", "allowed_token_ids must be a list of token ids.")
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "allowed_token_ids is not None and empty!")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list | tuple)
            or not all(isinstance(w, str) for w in self.bad_words)
        ):
            raise bad("bad_words", "bad_words must be a list of strings.")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "structured_outputs must be a StructuredOutputsParams.")

    def verify_vocab(self, vocab_size: int) -> None:
        """Checks that need the model's vocabulary size (run by the engine when a request arrives)."""
        if self.logit_bias:
            invalid = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if invalid:
                raise InvalidRequestError(
                    f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab_size}",
                    param="logit_bias",
                )
        if self.allowed_token_ids is not None and not all(
            0 <= t < vocab_size for t in self.allowed_token_ids
        ):
            raise InvalidRequestError(
                "allowed_token_ids contains out-of-vocab token id!", param="allowed_token_ids"
            )
        if self.stop_token_ids and not all(t < vocab_size for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids contains out-of-vocab token id!", param="stop_token_ids"
            )
        if self.bad_words_token_ids:
            invalid = sorted({t for ids in self.bad_words_token_ids for t in ids if not 0 <= t < vocab_size})
            if invalid:
                raise InvalidRequestError(
                    f"The model vocabulary size is {vocab_size}, but the following tokens were specified as "
                    f"bad: {invalid}. All token id values should be integers satisfying: "
                    f"0 <= token_id < {vocab_size}.",
                    param="bad_words",
                )

    def bad_words_to_token_ids(self, tokenizer: Any) -> list[list[int]]:
        """vLLM's rule: each bad word as tokenized alone and, when it tokenizes differently to as many
        tokens, with a leading space (the form it takes inside a sentence)."""
        out: list[list[int]] = []
        for word in self.bad_words or ():
            for add_prefix_space in (False, True):
                prompt = (" " if add_prefix_space else "") + word.lstrip()
                ids = list(tokenizer.encode(prompt, add_special_tokens=False))
                if not ids:
                    continue
                if not add_prefix_space or (out and ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                    out.append(ids)
        return out


def _clamped_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must be a map from token ids to numbers.", param="logit_bias")
    out: dict[int, float] = {}
    for token, value in bias.items():
        try:
            tid = int(token)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {token!r}.", param="logit_bias"
            ) from None
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise InvalidRequestError(
                f"logit_bias values must be numbers, got {value!r}.", param="logit_bias"
            )
        out[tid] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return out
