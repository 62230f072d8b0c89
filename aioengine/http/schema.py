"""Request bodies' shared machinery: per-request limits, the JSON body reader with its depth cap, and
strictly typed field access (Fields) with the schema each table declares."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, overload

import orjson

from aioengine.http.errors import APIError, bad


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for (400 beyond): each cap bounds work done on the event loop.

    Set through `ServerConfig.limits` (or `aioengine serve --request-limit NAME=VALUE`); docs/api.md.
    """

    max_json_depth: int = 64  # nesting of a body or websocket message (objects and arrays)
    max_n: int = 128  # OpenAI's cap on n
    max_prompts: int = 256  # prompts x n in one /v1/completions request
    max_messages: int = 4096  # chat messages (the template renders each)
    max_stop: int = 32  # stop strings: each is searched after every token, on the event loop
    max_stop_chars: int = 1024  # per stop string: the stream holds back up to this much text
    max_token_ids: int = 16384  # stop_token_ids, allowed_token_ids
    max_logit_bias: int = 1024  # logit_bias entries
    max_bad_words: int = 128  # bad_words (each is tokenized and matched after every token)


DEFAULT_LIMITS = RequestLimits()


def parse_json_body(
    raw: bytes | str, max_depth: int = DEFAULT_LIMITS.max_json_depth, what: str = "request body"
) -> dict:
    if not raw.strip():
        raise bad(f"The {what} is empty; expected a JSON object.")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth" in str(e):  # orjson's own cap (1024) is above ours
            raise _too_deep(what, max_depth) from None
        raise bad(f"The {what} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad(f"The {what} must be a JSON object, got {type(data).__name__}.")
    if _deeper_than(data, max_depth):
        raise _too_deep(what, max_depth)
    return data


def _too_deep(what: str, max_depth: int) -> APIError:
    return bad(f"The {what} nests objects and arrays deeper than {max_depth} levels.")


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether JSON containers nest more than `limit` levels (the top object is level 1); iterative."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if type(c) is dict or type(c) is list)
    return False


# ---- request fields: one spec per field, read by Fields and stated by /openapi.json ---------------------
JSON = dict[str, Any]
Bound = int | float | Callable[[RequestLimits], int] | None  # a callable reads it from the server's limits
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    str: "a string",
    list: "an array",
    dict: "an object",
}
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}


@dataclass(frozen=True, slots=True)
class SchemaContext:
    """What a field's schema may depend on: the server's limits, the model's vocabulary, its policy."""

    limits: RequestLimits = DEFAULT_LIMITS
    vocab_size: int = 1 << 31
    priority: bool = False

    def token(self) -> JSON:
        return {"type": "integer", "minimum": 0, "maximum": max(self.vocab_size - 1, 0)}


@dataclass(frozen=True, slots=True)
class Spec:
    """One request field: the type, bounds and choices Fields checks, and the schema /openapi.json states.

    ``kind``: the JSON type Fields reads (None: any; the parser reads the field itself). ``lo``/``hi``
    (inclusive unless ``exclusive_lo``) and ``enum`` are checked by Fields unless ``checked_later``: then
    SamplingParams or the engine checks them (sampling fields take their bounds from sampling_params.BOUNDS,
    the same numbers), with vLLM's messages, and the spec states them.
    ``schema``: more JSON schema (a callable gets the SchemaContext), for what the type and bounds cannot say.
    """

    kind: type | None
    lo: Bound = None
    hi: Bound = None
    exclusive_lo: bool = False
    enum: tuple[str, ...] | None = None
    checked_later: bool = False
    schema: JSON | Callable[[SchemaContext], JSON] | None = None
    description: str | None = None

    def bounds(self, limits: RequestLimits) -> tuple[float | None, float | None]:
        def resolve(b: Bound) -> float | None:
            return b(limits) if callable(b) else b

        return resolve(self.lo), resolve(self.hi)

    def json_schema(self, ctx: SchemaContext) -> JSON:
        out: JSON = {} if self.kind is None else {"type": _JSON_TYPES[self.kind]}
        if self.enum is not None:
            out = {"enum": list(self.enum)}
        lo, hi = self.bounds(ctx.limits)
        if lo is not None:
            out["exclusiveMinimum" if self.exclusive_lo else "minimum"] = lo
        if hi is not None:
            out["maximum"] = hi
        extra = self.schema(ctx) if callable(self.schema) else self.schema
        out.update(extra or {})
        if self.description is not None:
            out["description"] = self.description
        return out


Table = Mapping[str, Spec]


def object_schema(
    table: Table,
    ctx: SchemaContext,
    required: tuple[str, ...] = (),
    nullable: bool = True,
    only: tuple[str, ...] | None = None,
    **extra: object,
) -> JSON:
    """The JSON schema of an object of these fields (``only``: a subset): unknown fields are refused, and
    null means the default for every field not required (``nullable``)."""
    props = {}
    for name, spec in table.items():
        if only is not None and name not in only:
            continue
        schema = spec.json_schema(ctx)
        props[name] = {"anyOf": [schema, {"type": "null"}]} if nullable and name not in required else schema
    return {
        "type": "object",
        "properties": props,
        "required": list(required),
        "additionalProperties": False,
        **extra,
    }


class Fields:
    """Reads fields of a JSON object with strict types; null means "use the default" as in OpenAI's API.

    ``allowed``: the field table (its specs' bounds and choices are checked), or just the allowed names.
    """

    def __init__(
        self,
        data: JSON,
        allowed: Table | frozenset[str],
        prefix: str = "",
        limits: RequestLimits = DEFAULT_LIMITS,
    ) -> None:
        for key in data:
            if key not in allowed:
                raise bad(f"Unrecognized request argument supplied: {prefix}{key}", f"{prefix}{key}")
        self.data = data
        self.specs: Table = allowed if isinstance(allowed, Mapping) else {}
        self.prefix = prefix
        self.limits = limits

    def get(self, name: str, kind: type, default: Any = None) -> Any:
        value = self.data.get(name)
        if value is None:
            return default
        if kind is int and type(value) is float and value.is_integer():
            value = int(value)  # JSON does not tell 4 from 4.0 (nor does vLLM)
        ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise bad(
                f"{self.prefix}{name} must be {_TYPE_NAMES[kind]}, got {_json_type(value)}.",
                f"{self.prefix}{name}",
            )
        return value

    def _checked(self, name: str, value: Any) -> Any:
        spec = self.specs.get(name)
        if value is None or spec is None or spec.checked_later:
            return value
        param = f"{self.prefix}{name}"
        if spec.enum is not None and value not in spec.enum:
            raise bad(f"{param} must be one of {', '.join(spec.enum)}; got {value!r}.", param)
        lo, hi = spec.bounds(self.limits)
        if (lo is not None and (value <= lo if spec.exclusive_lo else value < lo)) or (
            hi is not None and value > hi
        ):
            rng = (
                f"at least {lo}"
                if hi is None
                else f"between {lo} and {hi}"
                if lo is not None
                else f"at most {hi}"
            )
            raise bad(f"{param} must be {rng}, got {value}.", param)
        return value

    @overload
    def int(self, name: builtins.str, default: builtins.int) -> builtins.int: ...
    @overload
    def int(self, name: builtins.str, default: None = None) -> builtins.int | None: ...

    def int(self, name: builtins.str, default: builtins.int | None = None) -> builtins.int | None:
        return self._checked(name, self.get(name, int, default))

    @overload
    def float(self, name: builtins.str, default: builtins.float) -> builtins.float: ...
    @overload
    def float(self, name: builtins.str, default: None = None) -> builtins.float | None: ...

    def float(self, name: builtins.str, default: builtins.float | None = None) -> builtins.float | None:
        return self._checked(name, self.get(name, float, default))

    @overload
    def bool(self, name: builtins.str, default: builtins.bool) -> builtins.bool: ...
    @overload
    def bool(self, name: builtins.str, default: None = None) -> builtins.bool | None: ...

    def bool(self, name: builtins.str, default: builtins.bool | None = None) -> builtins.bool | None:
        return self.get(name, bool, default)

    @overload
    def str(self, name: builtins.str, default: builtins.str) -> builtins.str: ...
    @overload
    def str(self, name: builtins.str, default: None = None) -> builtins.str | None: ...

    def str(self, name: builtins.str, default: builtins.str | None = None) -> builtins.str | None:
        return self._checked(name, self.get(name, str, default))

    def present(self, name: builtins.str) -> builtins.bool:
        return self.data.get(name) is not None


def _ints(values: list) -> list[int] | None:
    """The list with integral floats (4.0) as ints; None when an item is not an integer."""
    out = []
    for v in values:
        if type(v) is float and v.is_integer():
            v = int(v)
        if type(v) is not int:
            return None
        out.append(v)
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in _TYPE_NAMES.items():
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _at_most(values: Any, limit: int, param: str, what: str) -> None:
    if values is not None and len(values) > limit:
        raise bad(f"{param} may hold at most {limit} {what}, got {len(values)}.", param)
