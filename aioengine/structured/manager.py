"""Compiles structured-output constraints with xgrammar (cached by key) and fills the step's grammar bitmask.

Everything here runs on the event loop: compiling at generate() (a few ms for a typical schema, then
cached), filling the bitmask while the worker runs the forward (stop 8), advancing matchers as tokens
arrive (stop 11). The scheduler only calls Grammar.accept_token / is_terminated and grammar_bitmask().
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import StructuredOutputsParams
from aioengine.sched.output import GrammarOutput
from aioengine.structured.budget import ThinkingBudget

logger = logging.getLogger(__name__)

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")

# A think block's text up to and with the first </think>, then whitespace: EBNF has no "not containing", so
# state sK has matched K characters of "</think>" (a "<" always restarts the match at s1).
_THINK_TEXT = r"""
s0 ::= [^<]* "<" s1
s1 ::= "/" s2 | "<" s1 | [^/<] s0
s2 ::= "t" s3 | "<" s1 | [^t<] s0
s3 ::= "h" s4 | "<" s1 | [^h<] s0
s4 ::= "i" s5 | "<" s1 | [^i<] s0
s5 ::= "n" s6 | "<" s1 | [^n<] s0
s6 ::= "k" s7 | "<" s1 | [^k<] s0
s7 ::= ">" [ \t\r\n]* | "<" s1 | [^><] s0
"""
# What comes before the answer, per reasoning parser (aioengine/http/reasoning.py's rules): qwen3 opens an
# optional block with <think>; deepseek_r1's template opens it in the prompt, so the output starts inside it.
_THINK_BLOCKS = {
    "qwen3": r'root ::= [ \t\r\n]* "<think>" s0' + _THINK_TEXT,
    "deepseek_r1": "root ::= s0" + _THINK_TEXT,
}


class Grammar:
    """One request's grammar state: an xgrammar matcher over the compiled grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of the step's bitmask; every token stays allowed once the grammar is terminated."""
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        max_threads: int = 2,
        cache_size: int = 512,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stop = [eos_token_id] if eos_token_id is not None else None
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.bitmask_width = (vocab_size + 31) // 32
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0

    # ---- at generate(): compile (cached) --------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a constraint; InvalidRequestError when it does not compile."""
        key = params.cache_key()
        with self._lock:  # the loop and precompile's threads share the cache (the compile itself is unlocked)
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return compiled
            self.cache_misses += 1
        compiled = self._compile(params)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, p: StructuredOutputsParams) -> Any:
        if p.reasoning is not None and p.reasoning not in _THINK_BLOCKS:
            raise InvalidRequestError(
                f"structured_outputs.reasoning must be one of {', '.join(_THINK_BLOCKS)}",
                param="structured_outputs",
            )
        kind = p.kinds()[0]
        try:
            grammar = self._grammar(p, kind)
            if p.reasoning is not None:  # the answer's grammar after the think block
                xgr = self._xgr
                think = xgr.Grammar.concat(xgr.Grammar.from_ebnf(_THINK_BLOCKS[p.reasoning]), grammar)
                grammar = think if p.reasoning == "deepseek_r1" else xgr.Grammar.union(think, grammar)
            return self.compiler.compile_grammar(grammar)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar reports bad specs as RuntimeError / ValueError
            what = {
                "json": "JSON schema",
                "json_object": "JSON grammar",
                "regex": "regular expression",
                "choice": "choice",
                "grammar": "grammar",
            }[kind]
            msg = _XGR_PREFIX.sub("", str(e).strip())
            raise InvalidRequestError(
                f"Invalid {what} for structured outputs: {msg}", param="structured_outputs"
            ) from None

    def _grammar(self, p: StructuredOutputsParams, kind: str) -> Any:
        """The constraint as an xgrammar Grammar (not yet compiled)."""
        xgr = self._xgr
        if kind == "json":
            schema = p.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InvalidRequestError(
                        f"Invalid JSON schema: not valid JSON ({e})", param="structured_outputs"
                    ) from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(
                    "Invalid JSON schema: it must be an object", param="structured_outputs"
                )
            return xgr.Grammar.from_json_schema(
                json.dumps(schema), any_whitespace=not p.disable_any_whitespace
            )
        if kind == "json_object":
            # OpenAI's JSON mode: an object, not any JSON value; compact, because free whitespace let
            # a small model emit newlines until max_tokens (SmolLM2-135M did).
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(p.regex)
        if kind == "choice":
            assert p.choice is not None  # kinds() names "choice" only when it is set
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        return xgr.Grammar.from_ebnf(p.grammar)

    def new_grammar(self, compiled: Any) -> Grammar:
        return Grammar(self._xgr.GrammarMatcher(compiled))

    def thinking_budget(
        self, budget: int, reasoning_parser: str | None, inner: Grammar | None
    ) -> ThinkingBudget:
        """A request's thinking budget (around its grammar, if it has one)."""
        return ThinkingBudget(
            budget, reasoning_parser == "deepseek_r1", self.token_bytes, self._closing_ids, inner
        )

    @functools.lru_cache(maxsize=16)  # noqa: B019 (one manager per engine, a handful of strings)
    def _closing_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token id's text as bytes (xgrammar's decoded vocabulary), for finding the think tags."""
        return [bytes(b) for b in self.tokenizer_info.decoded_vocab]

    # ---- stop 8: the bitmask -------------------------------------------------------------------
    def grammar_bitmask(self, req_ids: list[str], grammars: list[Any]) -> GrammarOutput:
        """One row per request (a Grammar or a ThinkingBudget), every token allowed where the grammar is
        already terminated."""
        bitmask = np.full((len(req_ids), self.bitmask_width), -1, dtype=np.int32)
        matchers, rows = [], []
        for i, g in enumerate(grammars):
            if not isinstance(g, Grammar):
                g.fill_bitmask(bitmask, i)  # a thinking budget fills its row (and its inner grammar's)
            elif not g.matcher.is_terminated():
                matchers.append(g.matcher)
                rows.append(i)
        if len(matchers) < 64:  # a few us each: threads only pay off for large batches
            for m, i in zip(matchers, rows, strict=True):
                m.fill_next_token_bitmask(bitmask, i)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return GrammarOutput(req_ids, bitmask)
