"""Nested request shapes (messages, tools, tool_choice, response_format, input items, stop): one
declaration checks a value, naming the innermost bad field, and states the JSON schema /openapi.json shows.

A shape only checks; the parser that owns the field then reads the checked value. Null inside an object means
"absent", as at the top level.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioengine.http.errors import bad, not_supported
from aioengine.http.schema import _JSON_TYPES, _TYPE_NAMES, JSON, Bound, SchemaContext, _at_most, _json_type


def _at(path: str, name: str) -> str:
    """A field's path inside ``path`` (the top level has none)."""
    return f"{path}.{name}" if path else name


def _resolve(b: Bound, ctx: SchemaContext) -> float | None:
    return b(ctx.limits) if callable(b) else b


def _type_error(path: str, kind: type, value: Any) -> Exception:
    return bad(f"{path} must be {_TYPE_NAMES[kind]}, got {_json_type(value)}.", path)


def _is(kind: type | None, value: Any) -> bool:
    if kind is None:
        return True
    if kind in (int, float):  # JSON does not tell 4 from 4.0
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and (kind is float or isinstance(value, int) or value.is_integer())
    return isinstance(value, kind)


class Shape:
    """The interface: `check` raises the route's 400 (APIError) for a bad value; `schema` states the shape."""

    json_kind: type | None = None  # the JSON type it takes (Either dispatches on it); None: any

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        raise NotImplementedError

    def schema(self, ctx: SchemaContext) -> JSON:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Value(Shape):
    """A scalar (or any object, `kind=dict`; anything, `kind=None`), with optional choices and length.

    ``pattern``: (regex, what it means in words) for the error message.
    """

    kind: type | None = None
    enum: tuple[str, ...] | None = None
    pattern: tuple[str, str] | None = None
    min_length: int | None = None
    max_length: Bound = None
    description: str | None = None

    @property
    def json_kind(self) -> type | None:  # type: ignore[override]
        return self.kind

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not _is(self.kind, value):
            assert self.kind is not None
            raise _type_error(path, self.kind, value)
        if self.enum is not None and value not in self.enum:
            choices = ", ".join(self.enum)
            raise bad(
                f"{path} must be {self.enum[0]!r}."
                if len(self.enum) == 1
                else f"{path} must be one of {choices}; got {value!r}.",
                path,
            )
        if self.pattern is not None and not re.fullmatch(self.pattern[0], value):
            raise bad(f"{path} must be {self.pattern[1]}.", path)
        if self.min_length and len(value) < self.min_length:
            raise bad(f"{path} must not be empty." if self.min_length == 1 else f"{path} is too short.", path)
        hi = _resolve(self.max_length, ctx)
        if hi is not None and len(value) > hi:
            raise bad(f"{path} may be at most {int(hi)} characters long, got {len(value)}.", path)

    def schema(self, ctx: SchemaContext) -> JSON:
        out: JSON = {} if self.kind is None else {"type": _JSON_TYPES[self.kind]}
        if self.enum is not None:
            out = {"const": self.enum[0]} if len(self.enum) == 1 else {"enum": list(self.enum)}
        if self.pattern is not None:
            out["pattern"] = f"^(?:{self.pattern[0]})$"
        if self.min_length:
            out["minLength"] = self.min_length
        hi = _resolve(self.max_length, ctx)
        if hi is not None:
            out["maxLength"] = int(hi)
        if self.description is not None:
            out["description"] = self.description
        return out


@dataclass(frozen=True, slots=True)
class Refused(Shape):
    """A field that does not belong here (a tool_call_id on a user message): present, it is refused."""

    reason: str  # "belongs to tool messages only"

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        raise bad(f"{path} {self.reason}.", path)

    def schema(self, ctx: SchemaContext) -> JSON:
        return {"not": {}, "description": self.reason}


@dataclass(frozen=True, slots=True)
class Unsupported(Shape):
    """A field the API defines that this server does not do: present (and not null), it is refused."""

    what: str

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        raise not_supported(path, self.what)

    def schema(self, ctx: SchemaContext) -> JSON:
        return {"not": {}, "description": f"not supported: {self.what}"}


@dataclass(frozen=True, slots=True)
class Obj(Shape):
    """An object of these fields; unknown ones are refused unless ``open``; null means absent."""

    fields: Mapping[str, Shape]
    required: tuple[str, ...] = ()
    open: bool = False
    json_kind = dict

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not isinstance(value, dict):
            raise _type_error(path, dict, value)
        if not self.open:
            for key in value:
                if key not in self.fields:
                    raise bad(f"Unrecognized request argument supplied: {_at(path, key)}", _at(path, key))
        for name in self.required:
            if value.get(name) is None:
                raise bad(f"{_at(path, name)} is required.", _at(path, name))
        for name, shape in self.fields.items():
            v = value.get(name)
            if v is not None:
                shape.check(v, _at(path, name), ctx)

    def schema(self, ctx: SchemaContext) -> JSON:
        props = {}
        for name, shape in self.fields.items():
            s = shape.schema(ctx)
            props[name] = s if name in self.required else {"anyOf": [s, {"type": "null"}]}
        out: JSON = {"type": "object", "properties": props, "required": list(self.required)}
        if not self.open:
            out["additionalProperties"] = False
        return out


@dataclass(frozen=True, slots=True)
class Array(Shape):
    """An array of ``items``; ``what`` names them in the too-many message."""

    items: Shape
    min_items: int = 0
    max_items: Bound = None
    what: str = "items"
    json_kind = list

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not isinstance(value, list):
            raise _type_error(path, list, value)
        if len(value) < self.min_items:
            raise bad(
                f"{path} must not be empty."
                if self.min_items == 1
                else f"{path} must hold at least {self.min_items} {self.what}.",
                path,
            )
        hi = _resolve(self.max_items, ctx)
        if hi is not None:
            _at_most(value, int(hi), path, self.what)
        if isinstance(self.items, TokenId):  # a long prompt of ids: one pass, names the bad one only if any
            vocab = ctx.vocab_size
            if all(type(v) is int and 0 <= v < vocab for v in value):
                return
        for i, item in enumerate(value):
            self.items.check(item, f"{path}[{i}]", ctx)

    def schema(self, ctx: SchemaContext) -> JSON:
        out: JSON = {"type": "array", "items": self.items.schema(ctx)}
        if self.min_items:
            out["minItems"] = self.min_items
        hi = _resolve(self.max_items, ctx)
        if hi is not None:
            out["maxItems"] = int(hi)
        return out


@dataclass(frozen=True, slots=True)
class Either(Shape):
    """One of several shapes, told apart by JSON type (a string or an array of parts, say)."""

    options: tuple[Shape, ...]
    what: str  # for the message: "a string or an array of content parts"
    description: str | None = None

    def __post_init__(self) -> None:
        kinds = [o.json_kind for o in self.options]
        assert None not in kinds and len(set(kinds)) == len(kinds), (
            "Either's options must differ in JSON type"
        )

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        for option in self.options:
            if _is(option.json_kind, value):
                option.check(value, path, ctx)
                return
        raise bad(f"{path} must be {self.what}, got {_json_type(value)}.", path)

    def schema(self, ctx: SchemaContext) -> JSON:
        out: JSON = {"anyOf": [o.schema(ctx) for o in self.options]}
        if self.description is not None:
            out["description"] = self.description
        return out


@dataclass(frozen=True, slots=True)
class Tagged(Shape):
    """An object whose ``key`` (role, type) picks its shape among ``cases``; each case declares the key too.

    ``unsupported``: a message (with ``{}`` for the tag) for tags the API has but this server lacks; they are
    refused as "not supported", naming the key. Without it an unknown tag is a bad value of the key.
    ``default``: the tag when the key is absent (None: the key is required).
    """

    key: str
    cases: Mapping[str, Obj]
    unsupported: str | None = None
    default: str | None = None
    json_kind = dict

    def __post_init__(self) -> None:
        assert all(self.key in case.fields for case in self.cases.values())

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not isinstance(value, dict):
            raise _type_error(path, dict, value)
        tag = value.get(self.key)
        if tag is None:
            tag = self.default
        if tag is None:
            raise bad(f"{_at(path, self.key)} is required.", _at(path, self.key))
        case = self.cases.get(tag) if isinstance(tag, str) else None
        if case is None:
            if self.unsupported is not None and isinstance(tag, str):
                raise not_supported(_at(path, self.key), self.unsupported.format(repr(tag)))
            raise bad(
                f"{_at(path, self.key)} must be one of {', '.join(self.cases)}; got {tag!r}.",
                _at(path, self.key),
            )
        case.check(value, path, ctx)

    def schema(self, ctx: SchemaContext) -> JSON:
        variants = []
        for tag, case in self.cases.items():
            s = case.schema(ctx)
            tag_schema: JSON = {"const": tag}
            if tag == self.default:
                s["properties"][self.key] = {"anyOf": [tag_schema, {"type": "null"}]}
            else:
                s["properties"][self.key] = tag_schema
                s["required"] = sorted({*s["required"], self.key})
            variants.append(s)
        return {"oneOf": variants}


@dataclass(frozen=True, slots=True)
class TokenId(Shape):
    """A token id: an integer (4.0 counts) in [0, vocab_size) of the context's vocabulary."""

    json_kind = int

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not _is(int, value) or not 0 <= value < ctx.vocab_size:
            raise bad(f"{path} must be a token id, an integer in [0, {ctx.vocab_size}); got {value!r}.", path)

    def schema(self, ctx: SchemaContext) -> JSON:
        return ctx.token()


@dataclass(frozen=True, slots=True)
class ListOf(Shape):
    """An array whose items all take one option's item shape, picked by the first item's JSON type (a
    prompt: strings, token ids, or arrays of token ids)."""

    options: tuple[Array, ...]
    what: str  # for the message: "an array of strings, of token ids, or of arrays of token ids"
    json_kind = list

    def __post_init__(self) -> None:
        kinds = [o.items.json_kind for o in self.options]
        assert None not in kinds and len(set(kinds)) == len(kinds), (
            "ListOf's options must differ in item type"
        )

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not isinstance(value, list):
            raise _type_error(path, list, value)
        if not value:
            raise bad(f"{path} must not be empty.", path)
        for option in self.options:
            if _is(option.items.json_kind, value[0]):
                option.check(value, path, ctx)
                return
        raise bad(f"{path} must be {self.what}; {path}[0] is {_json_type(value[0])}.", f"{path}[0]")

    def schema(self, ctx: SchemaContext) -> JSON:
        return {"anyOf": [o.schema(ctx) for o in self.options]}


@dataclass(frozen=True, slots=True)
class Map(Shape):
    """An object used as a map: keys (matching ``key_pattern``: (regex, words); not one of ``reserved``)
    to ``values``, at most ``max_entries`` of them."""

    values: Shape
    key_pattern: tuple[str, str] | None = None
    reserved: frozenset[str] = frozenset()
    max_entries: Bound = None
    description: str | None = None
    json_kind = dict

    def check(self, value: Any, path: str, ctx: SchemaContext) -> None:
        if not isinstance(value, dict):
            raise _type_error(path, dict, value)
        hi = _resolve(self.max_entries, ctx)
        if hi is not None:
            _at_most(value, int(hi), path, "entries")
        for key, item in value.items():
            if key in self.reserved:
                raise bad(f"{path} may not set {key!r}.", _at(path, key))
            if self.key_pattern is not None and not re.fullmatch(self.key_pattern[0], key):
                raise bad(f"{path} keys must be {self.key_pattern[1]}, got {key!r}.", _at(path, key))
            self.values.check(item, _at(path, key), ctx)

    def schema(self, ctx: SchemaContext) -> JSON:
        out: JSON = {"type": "object", "additionalProperties": self.values.schema(ctx)}
        hi = _resolve(self.max_entries, ctx)
        if hi is not None:
            out["maxProperties"] = int(hi)
        if self.key_pattern is not None:
            out["propertyNames"] = {"pattern": f"^(?:{self.key_pattern[0]})$"}
        elif self.reserved:
            out["propertyNames"] = {"not": {"enum": sorted(self.reserved)}}
        if self.description is not None:
            out["description"] = self.description
        return out
