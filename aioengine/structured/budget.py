"""A thinking budget (SamplingParams.thinking_token_budget): at most N tokens in the think block, then the
engine forces "</think>" token by token and the answer follows.

It is a grammar to the scheduler (accept_token, is_terminated, and a bitmask row per step), so it gets what
structured outputs get: its bitmask is filled once the request's last token has arrived, and the request
does not speculate. A request's own grammar, when it has one, runs inside it: the row is that grammar's,
narrowed to the forced token while the block is being closed.

The block's tags are found in the output's text (each token's bytes), not by token ids: a tokenizer without
<think> as one token spells it in pieces, and not always the same ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from aioengine.sampling_params import THINK_END, THINK_START

START, END = THINK_START.encode(), THINK_END.encode()


class ThinkingBudget:
    __slots__ = (
        "budget",
        "closing_ids",
        "end_ids",
        "inner",
        "spent",
        "state",
        "tail",
        "token_bytes",
        "forced",
    )

    def __init__(
        self,
        budget: int,
        opens_inside: bool,
        token_bytes: list[bytes],
        closing_ids: Callable[[str], list[int]],
        inner: Any = None,
    ) -> None:
        """``opens_inside``: the output starts in the block (deepseek_r1), else it waits for "<think>".
        ``token_bytes``: each token id's text; ``closing_ids(text)``: the tokens to force for the rest of
        "</think>" (all of it, or what a tag the model had begun still lacks); ``inner``: the request's own
        Grammar, or None."""
        self.budget, self.closing_ids, self.inner, self.token_bytes = budget, closing_ids, inner, token_bytes
        self.end_ids: list[int] = []  # the tokens being forced
        self.spent = 0  # tokens in the block so far
        self.forced = 0  # of end_ids, while closing
        self.tail = b""  # the last bytes seen, where a tag may be forming
        self.state = "idle"  # idle (before the block), thinking, closing, done
        if opens_inside:
            self._enter()

    def _enter(self) -> None:
        self.state, self.tail = "thinking", b""
        if self.budget == 0:
            self._close()

    def _close(self) -> None:
        """Force the rest of "</think>": a tag the model had begun is finished, not written twice."""
        begun = next((k for k in range(len(END) - 1, 0, -1) if self.tail.endswith(END[:k])), 0)
        self.state, self.forced = "closing", 0
        self.end_ids = self.closing_ids(END[begun:].decode())
        assert self.end_ids, "the closing tag must tokenize to something"

    def accept_token(self, token: int) -> bool:
        if self.inner is not None and not self.inner.accept_token(token):
            return False
        if self.state == "closing":
            if token != self.end_ids[self.forced]:
                return False
            self.forced += 1
            if self.forced == len(self.end_ids):
                self.state = "done"
            return True
        if self.state == "done":
            return True
        text = self.tail + (self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b"")
        if self.state == "idle":
            at = text.find(START)
            self.tail = text[-(len(START) - 1) :]
            if at >= 0:
                self._enter()
                rest = text[at + len(START) :]  # what the same token wrote after the tag
                if rest and self.state == "thinking":
                    self._think(rest)
            return True
        self._think(text, count=True)
        return True

    def _think(self, text: bytes, count: bool = False) -> None:
        if END in text:
            self.state = "done"  # the model closed the block itself
            return
        self.tail = text[-(len(END) - 1) :]
        if count:
            self.spent += 1
            if self.spent >= self.budget:
                self._close()

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of the step's bitmask (int32 words of 32 tokens, all ones on entry)."""
        if self.inner is not None:
            self.inner.fill_bitmask(bitmask, row)
        if self.state == "closing":
            token = self.end_ids[self.forced]
            word, bit = divmod(token, 32)
            keep = bitmask[row, word] & np.int32(np.uint32(1 << bit).view(np.int32))
            bitmask[row] = 0
            bitmask[row, word] = keep
