"""Reasoning parsers (--reasoning-parser qwen3 | deepseek_r1 | openai_gptoss): a completion's reasoning split
from its answer, whole or as it streams.

deepseek_r1: the chat template opens the think block in the prompt, so the output is reasoning until
</think> (a leading <think> is dropped); cut short, it is reasoning only. qwen3: the output reasons only
when it opens with <think> (so `enable_thinking: false`, whose template leaves the block out, gives plain
content); an unclosed block is reasoning. Streaming holds back a tail that could still become a tag, so the
split never depends on how the text was cut into deltas.

openai_gptoss (vLLM's name): gpt-oss writes OpenAI's harmony format, its special tokens kept in the text
(the chat route decodes them for this parser): messages ``<|channel|>NAME<|message|>BODY`` ended by
``<|end|>``, ``<|return|>`` or ``<|call|>``, each after the first opened by ``<|start|>assistant``. The
analysis channel is reasoning; the final and commentary channels are the answer; the markup is dropped; a
message to ``functions.NAME`` is a call of NAME with its body as the arguments.
Output that does not open with a harmony marker is all answer.
"""

from __future__ import annotations

import re

from aioengine.sampling_params import REASONING_PARSERS as PARSERS
from aioengine.sampling_params import THINK_END as END
from aioengine.sampling_params import THINK_START as START

HARMONY = "openai_gptoss"
_MESSAGE, _ENDS = "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    """One completion's split. ``feed`` each piece of text as it comes, ``flush`` at the end; each returns
    the (reasoning, content) text that may go out now."""

    def __init__(self, kind: str) -> None:
        assert kind in PARSERS, kind
        self.kind = kind
        self.text = ""
        self.mode = "open?"  # open? (a <think> may still begin), reasoning, content
        self.start = 0  # where the text not yet handed out begins
        self.reasoned = False  # the output had a think block (or, deepseek_r1, always)

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        reasoning = ""
        while True:
            rest = self.text[self.start :]
            if self.mode == "open?":
                stripped = rest.lstrip()
                if stripped.startswith(START):  # the block opens here: the tag itself is dropped
                    self.start += len(rest) - len(stripped) + len(START)
                elif not final and START.startswith(stripped):
                    return reasoning, ""  # could still become <think>
                elif self.kind == "qwen3":
                    self.mode = "content"  # no think block: all answer
                    continue
                self.mode, self.reasoned = "reasoning", True
                continue
            if self.mode == "content":
                self.start = len(self.text)
                return reasoning, rest
            at = rest.find(END)
            if at >= 0:
                reasoning += rest[:at]
                self.start += at + len(END)
                self.mode = "content"
                continue
            keep = 0 if final else _held(rest, END)
            reasoning += rest[: len(rest) - keep]
            self.start += len(rest) - keep
            return reasoning, ""

    def flush(self) -> tuple[str, str]:
        return self.feed("", final=True)


class HarmonyParser:
    """The openai_gptoss split, with ReasoningParser's interface; a message addressed ``to=functions.NAME``
    is a tool call: its body (the arguments) is held and handed out whole by ``take_calls``."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "header"  # header (markup up to <|message|>), body, plain (no harmony: all answer)
        self.channel = ""
        self.start = 0
        self.reasoned = False  # an analysis message has opened
        self.call: str | None = None  # the function the open message calls
        self._args = ""
        self._calls: list[tuple[str, str]] = []  # (name, arguments) not yet taken

    def take_calls(self) -> list[tuple[str, str]]:
        out, self._calls = self._calls, []
        return out

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        reasoning, content = "", ""
        while True:
            rest = self.text[self.start :]
            if self.mode == "plain":
                self.start = len(self.text)
                return reasoning, content + rest
            if self.mode == "header":
                lead = rest.lstrip()
                plain = lead and not lead.startswith("<|") and not (lead == "<" and not final)
                if plain and self.start == 0:  # not harmony at all
                    self.mode = "plain"
                    continue
                at = rest.find(_MESSAGE)
                if at < 0:
                    if final:  # a header cut short: no text of its own
                        self.start = len(self.text)
                    return reasoning, content
                header = rest[:at]
                channel = header.rpartition("<|channel|>")[2].split("<|", 1)[0].split()
                self.channel = channel[0] if channel else ""
                recipient = _RECIPIENT.search(header)
                self.call = recipient.group(1) if recipient else None
                self.reasoned |= self.channel == "analysis"
                self.start += at + len(_MESSAGE)
                self.mode = "body"
                continue
            ends = [(at, end) for end in _ENDS if (at := rest.find(end)) >= 0]
            if ends:
                at, end = min(ends)
                body, self.start, self.mode = rest[:at], self.start + at + len(end), "header"
            else:  # hold back a tail that may still become an end marker
                keep = 0 if final else max(_held(rest, end) for end in _ENDS)
                body = rest[: len(rest) - keep]
                self.start += len(body)
            if self.call is not None:
                self._args += body
                if ends or final:  # a call cut short is handed out as far as it came
                    self._calls.append((self.call, self._args))
                    self.call, self._args = None, ""
            elif self.channel == "analysis":
                reasoning += body
            else:
                content += body
            if not ends:
                return reasoning, content

    def flush(self) -> tuple[str, str]:
        return self.feed("", final=True)


def make_parser(kind: str) -> ReasoningParser | HarmonyParser:
    """The parser ``--reasoning-parser kind`` names (one per completion)."""
    return HarmonyParser() if kind == HARMONY else ReasoningParser(kind)


def split(kind: str, text: str) -> tuple[str | None, str]:
    """A finished completion's (reasoning, or None when it had no think block; content)."""
    parser = make_parser(kind)
    reasoning, content = parser.feed(text, final=True)
    return (reasoning if parser.reasoned else None), content


def closed_in_prompt(prompt_tail: str) -> bool:
    """Whether a rendered prompt's tail already closes its think block (Qwen3's template with
    ``enable_thinking: false`` writes an empty one): what the model writes then is all answer."""
    start = prompt_tail.rfind(START)
    return start >= 0 and prompt_tail.find(END, start) >= 0
