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

from aioengine.http.errors import APIError
from aioengine.http.schema import SchemaContext
from aioengine.http.shapes import Array, Either, Obj, Tagged, Value

MAX_TOOLS = 128
_NAME_PATTERN = r"[A-Za-z0-9_.\-]{1,64}"
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


_TEXT = Value(str)
FUNCTION = Obj(
    {
        "name": Value(str, pattern=(_NAME_PATTERN, "1-64 letters, digits, '_', '.' or '-'")),
        "description": _TEXT,
        "strict": Value(bool),
        "parameters": Value(dict, description="a JSON schema (forced calls are constrained to it)"),
    },
    ("name",),
)
TOOLS = Array(
    Tagged(
        "type", {"function": Obj({"type": _TEXT, "function": FUNCTION}, ("function",))}, "Tools of type {}"
    ),
    max_items=MAX_TOOLS,
    what="tools",
)
TOOL_CHOICE = Either(
    (
        Value(str, enum=("none", "auto", "required")),
        Obj(
            {
                "type": Value(str, enum=("function",)),
                "function": Obj({"name": FUNCTION.fields["name"]}, ("name",)),
            },
            ("type", "function"),
        ),
    ),
    '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
    description="needs tools; a named function must be one of them (docs/api.md, Tool calling)",
)
# An assistant message's earlier calls, as clients send them back: other keys (a streamed delta's index) pass.
TOOL_CALLS = Array(
    Obj(
        {
            "id": _TEXT,
            "type": Value(str, enum=("function",)),
            "function": Obj(
                {"name": _TEXT, "arguments": Either((_TEXT, Value(dict)), "a string or an object")},
                ("name",),
                open=True,
            ),
        },
        ("function",),
        open=True,
    )
)


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None) -> ToolSpec | None:
    """Validate the request's tool fields (TOOLS, TOOL_CHOICE); None when the request uses no tools."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice requires tools to be specified.", "tool_choice")
        return None
    ctx = SchemaContext()
    try:
        TOOLS.check(tools, "tools", ctx)
        if tool_choice is not None:
            TOOL_CHOICE.check(tool_choice, "tool_choice", ctx)
    except APIError as e:
        raise ToolError(e.message, e.param or "tools") from None
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if fn["name"] in schemas:
            raise ToolError(f"Two tools are named {fn['name']!r}.", f"tools[{i}].function.name")
        params = fn.get("parameters")
        schemas[fn["name"]] = {"type": "object", "properties": {}} if params is None else params
    choice, forced = tool_choice or "auto", None
    if isinstance(tool_choice, dict):
        choice, forced = "named", tool_choice["function"]["name"]
        if forced not in schemas:
            raise ToolError(f"tool_choice names {forced!r}, which is not among the tools.", "tool_choice")
    return ToolSpec(
        tools=tools,
        choice=choice,
        name=forced,
        parallel=True if parallel is None else parallel,
        schemas=schemas,
    )


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's checked `tool_calls` (TOOL_CALLS) as chat templates read them (arguments as an
    object, as vLLM passes them: templates write `arguments | tojson`)."""
    out = []
    for j, call in enumerate(calls):
        fn = call["function"]
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the string as sent
                args = json.loads(args) if args.strip() else {}
        out.append(
            {
                "id": call.get("id") or f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def call_arguments(call: dict) -> Any:
    """A chat call's arguments (a JSON string) parsed, for the APIs that give them as an object (Anthropic's
    input, Ollama's arguments); ``{}`` where they do not parse (a call cut short)."""
    try:
        return json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return {}


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
