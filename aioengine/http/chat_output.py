"""One chat choice's output, parsed once for every API: reasoning split off, then tool calls, as events.

Each API formats the same events: OpenAI chat deltas, Anthropic content blocks, Responses items and the
websocket's messages. A finished completion is the stream fed at once (``parse_whole``), so the whole and
the streamed replies always agree, and so do the finish reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioengine.http.reasoning import HarmonyParser, make_parser
from aioengine.http.tools import StreamParser, ToolSpec, new_call_id


@dataclass(slots=True)
class Reasoning:
    text: str


@dataclass(slots=True)
class Content:
    text: str


@dataclass(slots=True)
class ToolCall:
    """A call, or a piece of one: an event with an ``id`` opens call ``index``; ``arguments`` extend it."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def chat_delta(self) -> dict:
        """The call as an OpenAI chat stream's `tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        fn = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": fn}


Event = Reasoning | Content | ToolCall


@dataclass(slots=True)
class ParsedChoice:
    """A finished choice: what a non-streamed reply holds."""

    reasoning: str | None  # None: the output had no think block (or no reasoning parser runs)
    content: str | None  # None: the output is only tool calls
    tool_calls: list[dict] = field(default_factory=list)  # chat's shape: id, type, function{name, arguments}
    finish_reason: str | None = None  # chat's: "tool_calls" once a non-forced call parsed

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


class ChatOutputParser:
    """One streamed choice: ``feed`` each text delta, ``finish`` with the engine's finish reason; each returns
    the events that may go out now. ``result()`` afterwards is the whole choice."""

    def __init__(self, reasoning_parser: str | None, tools: ToolSpec | None) -> None:
        self.thinker = make_parser(reasoning_parser) if reasoning_parser is not None else None
        self.calls = StreamParser(tools) if tools is not None and tools.choice != "none" else None
        self.answer_delta = ""  # the last feed's text after the reasoning split, before tool parsing
        self.finish_reason: str | None = None
        self.finished = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []
        self._harmony_called = False

    @property
    def tool_calls(self) -> list[dict]:
        """The calls so far, in chat's shape (a streamed call's arguments as far as they have come)."""
        return self._calls

    @property
    def called(self) -> bool:
        """Whether a tool call has begun."""
        return bool(self._calls)

    @property
    def reasoned(self) -> bool:
        """Whether a think block has opened (so a reasoning item or block exists, maybe still empty)."""
        return self.thinker is not None and self.thinker.reasoned

    def feed(self, delta: str) -> list[Event]:
        assert not self.finished, "feed after finish"
        return self._pass(delta, final=False)

    def finish(self, finish_reason: str | None) -> list[Event]:
        events = self._pass("", final=True)
        self.finish_reason = finish_reason
        if self.calls is not None:
            last, self.finish_reason = self.calls.finish(finish_reason)
            events += self._chat_events(last)
        if self._harmony_called and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        self.finished = True
        return events

    def result(self) -> ParsedChoice:
        assert self.finished, "result before finish"
        text = "".join(self._content)
        content: str | None = text
        if self._calls:  # text before a call is content, trimmed; none at all is null
            content = text.strip() or None
        return ParsedChoice(
            "".join(self._reasoning) if self.reasoned else None, content, self._calls, self.finish_reason
        )

    def _pass(self, piece: str, final: bool) -> list[Event]:
        events: list[Event] = []
        text = piece
        if self.thinker is not None:
            thought, text = self.thinker.feed(piece, final=final)
            if thought:
                self._reasoning.append(thought)
                events.append(Reasoning(thought))
            if isinstance(self.thinker, HarmonyParser):  # gpt-oss's calls come whole, from its own markup
                for name, arguments in self.thinker.take_calls():
                    fn = {"name": name, "arguments": arguments}
                    call = {"index": len(self._calls), "id": new_call_id(), "function": fn}
                    events += self._chat_events({"tool_calls": [call]})
                    self._harmony_called = True
        self.answer_delta = text
        if self.calls is None:
            if text:
                self._content.append(text)
                events.append(Content(text))
            return events
        if text or not final:
            events += self._chat_events(self.calls.delta(text))
        return events

    def _chat_events(self, delta: dict | None) -> list[Event]:
        events: list[Event] = []
        if not delta:
            return events
        if delta.get("content"):
            self._content.append(delta["content"])
            events.append(Content(delta["content"]))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            event = ToolCall(call.get("index", 0), fn.get("arguments") or "", call.get("id"), fn.get("name"))
            if event.id is not None:
                self._calls.append(
                    {
                        "id": event.id,
                        "type": "function",
                        "function": {"name": event.name, "arguments": event.arguments},
                    }
                )
            elif self._calls:
                self._calls[-1]["function"]["arguments"] += event.arguments
            events.append(event)
        return events


def parse_whole(
    reasoning_parser: str | None, tools: ToolSpec | None, text: str, finish_reason: str | None
) -> ParsedChoice:
    """A finished completion's text, parsed as if it had streamed in one piece."""
    parser = ChatOutputParser(reasoning_parser, tools)
    parser.feed(text)
    parser.finish(finish_reason)
    return parser.result()


def chat_delta(events: list[Event]) -> dict:
    """An OpenAI chat stream chunk's `delta` for these events (reasoning_content first)."""
    delta: dict = {}
    for e in events:
        if isinstance(e, Reasoning):
            delta["reasoning_content"] = delta.get("reasoning_content", "") + e.text
        elif isinstance(e, Content):
            delta["content"] = delta.get("content", "") + e.text
        else:
            delta.setdefault("tool_calls", []).append(e.chat_delta())
    return delta
