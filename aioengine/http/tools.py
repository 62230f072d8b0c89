"""Tool calling for chat: the `tools`/`tool_choice` fields, the grammar that forces a call, and the parser
that turns a completion's text into OpenAI `tool_calls`.

- `tool_choice` "none": the tools reach the chat template; the answer is plain content.
- `tool_choice` {"type": "function", ...} (a named function): the output is constrained to that function's
  `parameters` schema and returned as one call (finish_reason "stop", as OpenAI does for a forced call).
- `tool_choice` "required": the output is constrained to a JSON array of {"name", "parameters"} objects,
  one item at most when `parallel_tool_calls` is false (vLLM's schema); finish_reason "tool_calls".
- `tool_choice` "auto" (the default with tools): free generation; `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` blocks (the Hermes format of Qwen2.5/Qwen3/Hermes templates) become calls, the text before
  them stays content; so does a whole output in Mistral's (`[TOOL_CALLS] [...]`) or Llama 3's (`{"name",
  "parameters"}`) format naming one of the tools. Anything else stays content, so a model that never calls a
  tool answers as usual.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_TOOLS = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_WHOLE_PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")  # Mistral's and Llama 3's call markers
_BLOCK_RE = re.compile(re.escape(_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(_CLOSE) + r"|$)", re.DOTALL)


class ToolError(ValueError):
    """A malformed `tools`/`tool_choice`/tool message; `param` names the field (rendered as a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(slots=True)
class ToolSpec:
    tools: list[dict]  # as the client sent them ({"type": "function", "function": {...}}), for the template
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the forced function when choice == "named"
    parallel: bool = True
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> parameters schema

    def structured_outputs(self) -> dict | None:
        """The constraint that forces a call (named / required), as a structured_outputs dict."""
        # Compact JSON: free whitespace let a small model pad the arguments with newlines.
        if self.choice == "named":
            assert self.name is not None
            return {"json": self.schemas[self.name], "disable_any_whitespace": True}
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
                    "required": ["name", "parameters"],
                }
                for n, s in self.schemas.items()
            ]
            array: dict[str, Any] = {
                "type": "array",
                "minItems": 1,
                "items": items[0] if len(items) == 1 else {"anyOf": items},
            }
            if not self.parallel:
                array["maxItems"] = 1
            return {"json": array, "disable_any_whitespace": True}
        return None


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolSpec | None:
    """Validate the request's tool fields; None when the request uses no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice requires tools to be specified.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools must be an array of tool objects.", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"tools may hold at most {MAX_TOOLS} tools, got {len(tools)}.", "tools")
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{p} must be an object with type 'function'.", p)
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise ToolError(f"Unrecognized request argument supplied: {p}.{sorted(unknown)[0]}", p)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{p}.function must be an object.", f"{p}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ToolError(
                f"Unrecognized request argument supplied: {p}.function.{sorted(unknown)[0]}", f"{p}.function"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolError(
                f"{p}.function.name must be 1-64 letters, digits, '_', '.' or '-'.", f"{p}.function.name"
            )
        if name in schemas:
            raise ToolError(f"Two tools are named {name!r}.", f"{p}.function.name")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolError(f"{p}.function.description must be a string.", f"{p}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{p}.function.strict must be a boolean.", f"{p}.function.strict")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        elif not isinstance(params, dict):
            raise ToolError(
                f"{p}.function.parameters must be a JSON schema object.", f"{p}.function.parameters"
            )
        schemas[name] = params
    choice, forced = _choice(tool_choice, schemas)
    return ToolSpec(
        tools=tools,
        choice=choice,
        name=forced,
        parallel=True if parallel is None else parallel,
        schemas=schemas,
    )


def _choice(tool_choice: Any, schemas: dict[str, dict]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice.function.name must be a string.", "tool_choice.function.name")
        if name not in schemas:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
        return "named", name
    raise ToolError(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
        '{"name": ...}}.',
        "tool_choice",
    )


def template_tool_calls(calls: Any, p: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates read them (arguments as an object, as vLLM
    passes them: templates write `arguments | tojson`)."""
    if not isinstance(calls, list):
        raise ToolError(f"{p}.tool_calls must be an array.", f"{p}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        q = f"{p}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(
                f'{q} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}.', q
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the string as sent
                args = json.loads(args) if args.strip() else {}
        out.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def extract(
    spec: ToolSpec, text: str, finish_reason: str | None
) -> tuple[str | None, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a finished completion's text."""
    if spec.choice == "named":
        assert spec.name is not None
        return None, [_call(spec.name, text)], finish_reason
    if spec.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (length): nothing parseable; hand the text back as content
            return text, [], finish_reason
        calls = [
            _call(it["name"], it.get("parameters", {}))
            for it in items
            if isinstance(it, dict) and isinstance(it.get("name"), str)
        ]
        return None, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason
    if spec.choice == "auto" and _OPEN in text:
        calls = []
        for m in _BLOCK_RE.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                return text, [], finish_reason  # not a well-formed call: leave the text as it was
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, [], finish_reason
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        content = text[: text.index(_OPEN)].strip() or None
        return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    if spec.choice == "auto":
        calls = _whole_output_calls(spec, text)
        if calls:
            return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason
    return text, [], finish_reason


def _whole_output_calls(spec: ToolSpec, text: str) -> list[dict]:
    """Calls when the whole output is one in another family's format: Mistral's `[TOOL_CALLS] [{"name",
    "arguments"}]`, or Llama 3's JSON `{"name", "parameters"}` (one object, or several as a list or split by
    `;`), after an optional `<|python_tag|>`. Only names among the request's tools count, so an ordinary
    JSON answer stays content."""
    body = text.strip()
    for prefix in _WHOLE_PREFIXES:
        if body.startswith(prefix):
            body = body[len(prefix) :].strip()
            break
    if not body.startswith(("{", "[")):
        return []
    try:
        parsed = json.loads(body)
        items = parsed if isinstance(parsed, list) else [parsed]
    except ValueError:
        try:
            items = [json.loads(part) for part in body.split(";") if part.strip()]
        except ValueError:
            return []
    calls = []
    for it in items:
        args = it.get("arguments", it.get("parameters")) if isinstance(it, dict) else None
        if not isinstance(it, dict) or it.get("name") not in spec.schemas or not isinstance(args, dict | str):
            return []
        calls.append(_call(it["name"], args))
    return calls


class StreamParser:
    """One streamed choice: which text may go out as content now, and the calls once it finishes.

    Named: each delta is a piece of the call's arguments (the call's id and name go first). Required: the
    array is held and sent as whole calls at the end. Auto: content streams until a `<tool_call>` could be
    starting; from there the text is held and sent as calls (or, if it was not a call, as content) at the end.
    """

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of `text` already sent as content (auto)
        self.call_id = new_call_id() if spec.choice == "named" else None
        self.started = False

    def delta(self, new_text: str) -> dict | None:
        """The chunk's `delta` for this piece of text (None: nothing to send yet)."""
        self.text += new_text
        if self.spec.choice == "named":
            call = {"index": 0, "function": {"arguments": new_text}}
            if not self.started:
                self.started = True
                call.update(id=self.call_id, type="function")
                call["function"] = {"name": self.spec.name, "arguments": new_text}
            elif not new_text:
                return None
            return {"tool_calls": [call]}
        if self.spec.choice == "required":
            return None
        out = self._releasable()
        return {"content": out} if out else None

    def _releasable(self) -> str:
        """Content up to where a `<tool_call>` tag is (or could be) beginning; nothing while the output so far
        could still be a whole-output call (a JSON object or array, or Mistral's or Llama 3's marker)."""
        if self.sent == 0:
            head = self.text.lstrip()
            if not head or head[0] in "{[" or any(p.startswith(head[: len(p)]) for p in _WHOLE_PREFIXES):
                return ""
        at = self.text.find(_OPEN, self.sent)
        if at < 0 and self.text.find(_OPEN) >= 0:
            return ""  # a call began earlier: hold everything from there
        end = len(self.text) if at < 0 else at
        if at < 0:  # hold back a tail that could grow into the tag
            for k in range(min(len(_OPEN) - 1, end - self.sent), 0, -1):
                if _OPEN.startswith(self.text[end - k : end]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, finish_reason: str | None) -> tuple[dict | None, str | None]:
        """The last `delta` (held text or the calls), and the finish_reason to report."""
        if self.spec.choice == "named":
            return None, finish_reason
        content, calls, reason = extract(self.spec, self.text, finish_reason)
        if calls:
            return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, reason
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return ({"content": rest} if rest else None), reason
