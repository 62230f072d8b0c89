"""Chat messages from a request: their shape (MESSAGES, also /openapi.json's), then text parts joined and
tool calls and results kept for the chat template; and the chat-template arguments a request may set."""

from __future__ import annotations

from typing import Any

from aioengine.http.schema import DEFAULT_LIMITS, Fields, RequestLimits, SchemaContext
from aioengine.http.shapes import Array, Either, Map, Obj, Refused, Tagged, Unsupported, Value
from aioengine.http.tools import TOOL_CALLS, template_tool_calls

# Arguments of the tokenizer's apply_chat_template that the server sets itself, or that would let a client
# run a template of its own (Jinja, on the event loop).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tokenize",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
        "tokenizer",
    }
)


TEMPLATE_KWARGS = Map(
    Value(None), reserved=RESERVED_TEMPLATE_KWARGS, description="extra variables for the chat template"
)


def template_kwargs(f: Fields) -> dict:
    raw = f.data.get("chat_template_kwargs")
    if raw is None:
        return {}
    TEMPLATE_KWARGS.check(raw, "chat_template_kwargs", SchemaContext(f.limits))
    return dict(raw)


_TEXT = Value(str)
TEXT_PART = Tagged(
    "type", {"text": Obj({"type": _TEXT, "text": _TEXT}, ("text",))}, "Content parts of type {}"
)
CONTENT = Either((_TEXT, Array(TEXT_PART)), "a string or an array of content parts")
_COMMON = {
    "role": _TEXT,
    "name": _TEXT,
    "function_call": Unsupported("The deprecated function_call (use tool_calls)"),
    "audio": Unsupported("Audio input"),
}
_NOT_TOOL = Refused("belongs to tool messages only")
_NOT_ASSISTANT = Refused("belongs to assistant messages only")
_PLAIN = Obj(
    {**_COMMON, "content": CONTENT, "tool_call_id": _NOT_TOOL, "tool_calls": _NOT_ASSISTANT}, ("content",)
)
MESSAGE = Tagged(
    "role",
    {
        "system": _PLAIN,
        "developer": _PLAIN,
        "user": _PLAIN,
        "assistant": Obj(
            {
                **_COMMON,
                "content": CONTENT,
                "refusal": _TEXT,
                "tool_calls": TOOL_CALLS,
                "tool_call_id": _NOT_TOOL,
                # what a reasoning parser split off an earlier answer (vLLM takes either name): templates
                # such as Qwen3's render it for the turns after the last user message
                "reasoning_content": _TEXT,
                "reasoning": _TEXT,
            }
        ),
        "tool": Obj(
            {**_COMMON, "content": CONTENT, "tool_call_id": _TEXT, "tool_calls": _NOT_ASSISTANT},
            ("content", "tool_call_id"),
        ),
    },
)
MESSAGES = Array(MESSAGE, min_items=1, max_items=lambda limits: limits.max_messages, what="messages")


def parse_messages(raw: Any, limits: RequestLimits = DEFAULT_LIMITS) -> list[dict]:
    """The chat template's messages: checked against MESSAGES, text parts joined, developer as system, an
    assistant's reasoning as ``reasoning_content``."""
    MESSAGES.check(raw, "messages", SchemaContext(limits))
    out = []
    for m in raw:
        role = m["role"]
        content = content_text(m.get("content"))
        if content is None:  # an assistant message with tool calls or a refusal only
            content = m.get("refusal") or ""
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = template_tool_calls(m["tool_calls"])
        reasoning = m.get("reasoning_content")
        if reasoning is None:  # null means absent: the other name may carry it
            reasoning = m.get("reasoning")
        if role == "assistant" and reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def content_text(content: str | list[dict] | None) -> str | None:
    """A checked message content as one string: a string as it is, text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content)
