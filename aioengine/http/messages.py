"""Chat messages from a request: checked, text parts joined, tool calls and results kept for the chat
template; and the chat-template arguments a request may set."""

from __future__ import annotations

from typing import Any

from aioengine.http.fields import DEFAULT_LIMITS, Fields, _at_most, _json_type, bad, not_supported
from aioengine.http.tools import ToolError, template_tool_calls

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_MESSAGE_FIELDS = frozenset(
    {"role", "content", "name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio"}
)


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


def template_kwargs(f: Fields) -> dict:
    kwargs = dict(f.get("chat_template_kwargs", dict, {}))
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad(f"chat_template_kwargs may not set {key!r}.", f"chat_template_kwargs.{key}")
    return kwargs


def parse_messages(raw: Any, max_messages: int = DEFAULT_LIMITS.max_messages) -> list[dict]:
    if not isinstance(raw, list):
        raise bad(f"messages must be an array, got {_json_type(raw)}.", "messages")
    if not raw:
        raise bad("messages must not be empty.", "messages")
    _at_most(raw, max_messages, "messages", "messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object, got {_json_type(m)}.", p)
        mf = Fields(m, _MESSAGE_FIELDS, p + ".")
        role = mf.str("role")
        if role is None:
            raise bad(f"{p}.role is required.", f"{p}.role")
        if mf.present("function_call"):
            raise not_supported(f"{p}.function_call", "The deprecated function_call (use tool_calls)")
        if role not in _ROLES:
            raise bad(
                f"{p}.role must be one of system, developer, user, assistant, tool; got {role!r}.",
                f"{p}.role",
            )
        if mf.present("audio"):
            raise not_supported(f"{p}.audio", "Audio input")
        content = content_text(m.get("content"), p)
        if content is None:
            if role != "assistant":
                raise bad(f"{p}.content is required.", f"{p}.content")
            content = mf.str("refusal") or ""
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        name = mf.str("name")
        if name is not None:
            msg["name"] = name
        if role == "tool":
            call_id = mf.str("tool_call_id")
            if call_id is None:
                raise bad(f"{p}.tool_call_id is required for a tool message.", f"{p}.tool_call_id")
            msg["tool_call_id"] = call_id
        elif mf.present("tool_call_id"):
            raise bad(f"{p}.tool_call_id belongs to tool messages only.", f"{p}.tool_call_id")
        if mf.present("tool_calls"):
            if role != "assistant":
                raise bad(f"{p}.tool_calls belongs to assistant messages only.", f"{p}.tool_calls")
            try:
                msg["tool_calls"] = template_tool_calls(m["tool_calls"], p)
            except ToolError as e:
                raise bad(e.message, e.param) from None
        out.append(msg)
    return out


_TEXT_PART = frozenset({"text"})
_TEXT_PART_FIELDS = frozenset({"type", "text"})


def content_text(
    content: Any,
    p: str,
    kinds: frozenset[str] = _TEXT_PART,
    part_fields: frozenset[str] | None = _TEXT_PART_FIELDS,
) -> str | None:
    """A message's content as one string: a string as it is, text parts (of the types ``kinds``) joined by
    newlines; None stays None. ``part_fields``: the keys a part may have (None: any)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(
            f"{p}.content must be a string or an array of content parts, got {_json_type(content)}.",
            f"{p}.content",
        )
    texts = []
    for j, part in enumerate(content):
        q = f"{p}.content[{j}]"
        if not isinstance(part, dict):
            raise bad(f"{q} must be an object.", q)
        kind = part.get("type")
        if kind not in kinds:
            raise not_supported(q, f"Content parts of type {kind!r}")
        pf = Fields(part, frozenset(part) if part_fields is None else part_fields, q + ".")
        text = pf.str("text")
        if text is None:
            raise bad(f"{q}.text is required.", f"{q}.text")
        texts.append(text)
    return "\n".join(texts)
