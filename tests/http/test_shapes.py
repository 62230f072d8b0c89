"""The nested request shapes (http/shapes.py): what a shape's check accepts is exactly what the JSON schema it
states for /openapi.json accepts, on random values built from the shape's own field names and tags."""

from __future__ import annotations

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioengine.http.anthropic.messages import COUNT_TOKENS_REQUEST, MESSAGES_REQUEST
from aioengine.http.errors import APIError
from aioengine.http.messages import MESSAGES, TEMPLATE_KWARGS
from aioengine.http.openai.responses import INPUT, TEXT_FORMAT
from aioengine.http.request_tables import (
    ALLOWED_TOKEN_IDS,
    BAD_WORDS,
    LOGIT_BIAS,
    METADATA,
    PROMPT,
    RESPONSE_FORMAT,
    STOP,
    STOP_TOKEN_IDS,
    TOKENS,
)
from aioengine.http.schema import RequestLimits, SchemaContext
from aioengine.http.shapes import (
    Array,
    Either,
    ListOf,
    Map,
    Obj,
    Refused,
    Shape,
    Tagged,
    TokenId,
    Unsupported,
    Value,
)
from aioengine.http.tools import TOOL_CALLS, TOOL_CHOICE, TOOLS

# Small limits, so that random arrays and strings reach them.
CTX = SchemaContext(
    RequestLimits(
        max_messages=3,
        max_stop=2,
        max_stop_chars=4,
        max_bad_words=2,
        max_prompts=3,
        max_token_ids=3,
        max_logit_bias=2,
    ),
    vocab_size=24,
)
SHAPES = {
    "messages": MESSAGES,
    "tools": TOOLS,
    "tool_choice": TOOL_CHOICE,
    "tool_calls": TOOL_CALLS,
    "response_format": RESPONSE_FORMAT,
    "input": INPUT,
    "text.format": TEXT_FORMAT,
    "stop": STOP,
    "bad_words": BAD_WORDS,
    "prompt": PROMPT,
    "stop_token_ids": STOP_TOKEN_IDS,
    "allowed_token_ids": ALLOWED_TOKEN_IDS,
    "tokens": TOKENS,
    "logit_bias": LOGIT_BIAS,
    "metadata": METADATA,
    "chat_template_kwargs": TEMPLATE_KWARGS,
    # Anthropic's Messages body, whole: its one declaration checks requests and states /openapi.json's schema
    "anthropic_messages": MESSAGES_REQUEST,
    "anthropic_count_tokens": COUNT_TOKENS_REQUEST,
}


def _words(shape: Shape, out: set[str]) -> set[str]:
    """Every field name, tag and choice the shape mentions: the vocabulary random values are built from."""
    if isinstance(shape, Value) and shape.enum:
        out.update(shape.enum)
    elif isinstance(shape, Obj):
        out.update(shape.fields)
        for s in shape.fields.values():
            _words(s, out)
    elif isinstance(shape, Array):
        _words(shape.items, out)
    elif isinstance(shape, Map):
        out.update(shape.reserved)
        _words(shape.values, out)
    elif isinstance(shape, ListOf | Either):
        for s in shape.options:
            _words(s, out)
    elif isinstance(shape, Tagged):
        out.update(shape.cases)
        for s in shape.cases.values():
            _words(s, out)
    return out


def _values(shape: Shape) -> st.SearchStrategy:
    words = sorted(_words(shape, set()) | {"x", "get_weather", "has space", "xxxxxx"})
    text = st.sampled_from(words) | st.text(alphabet="ab_-.", max_size=6)  # no newlines: see _schema_says
    scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | text
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(words), inner, max_size=5)
        ),
        max_leaves=24,
    )


_JUNK = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.sampled_from(["", "x", "zz"])


def _near(shape: Shape) -> st.SearchStrategy:
    """Values built along the shape, each part now and then replaced by junk (a wrong type, an unknown key,
    a missing one): many of them valid, the rest wrong in one or two places."""
    valid: st.SearchStrategy
    if isinstance(shape, Value):
        if shape.enum:
            valid = st.sampled_from(shape.enum)
        elif shape.kind is str:
            valid = st.text(alphabet="ab_-. ", max_size=6)
        elif shape.kind is bool:
            valid = st.booleans()
        elif shape.kind is dict:
            valid = st.dictionaries(st.sampled_from("abc"), st.integers(0, 2), max_size=2)
        else:
            valid = _JUNK
    elif isinstance(shape, Obj):
        refused = (Refused, Unsupported)  # present, these make the value invalid: only now and then
        optional = [
            k for k in shape.fields if k not in shape.required and not isinstance(shape.fields[k], refused)
        ]
        valid = st.fixed_dictionaries(
            {k: _near(shape.fields[k]) for k in shape.required},
            optional={k: _near(shape.fields[k]) for k in optional},
        )
        odd = [k for k in shape.fields if isinstance(shape.fields[k], refused)] + ["unknown_key"]
        extra = st.dictionaries(st.sampled_from(odd), _JUNK, min_size=1, max_size=1)
        valid = valid | st.tuples(valid, extra).map(lambda t: {**t[0], **t[1]})
    elif isinstance(shape, Array):
        valid = st.lists(_near(shape.items), max_size=4)
    elif isinstance(shape, TokenId):
        valid = st.integers(-1, 25) | st.sampled_from([3.0, 2.5])
    elif isinstance(shape, ListOf):
        valid = st.one_of([_near(o) for o in shape.options])
    elif isinstance(shape, Map):
        keys = st.sampled_from(["1", "23", "007", "abc", "x y", *sorted(shape.reserved)[:3]])
        valid = st.dictionaries(keys, _near(shape.values), max_size=3)
    elif isinstance(shape, Either):
        valid = st.one_of([_near(o) for o in shape.options])
    elif isinstance(shape, Tagged):
        valid = st.one_of(
            [
                _near(case).map(lambda d, t=tag: {**d, shape.key: t} if isinstance(d, dict) else d)
                for tag, case in shape.cases.items()
            ]
        )
    else:  # Refused, Unsupported
        valid = _JUNK
    return st.integers(0, 11).flatmap(lambda i: _JUNK if i == 0 else valid)


def _check_says(shape: Shape, value: object) -> bool:
    try:
        shape.check(value, "field", CTX)
    except APIError as e:
        assert e.status == 400 and e.message and e.param and e.param.startswith("field")
        return False
    return True


def _schema_says(schema: dict, value: object) -> bool:
    # Python's re (which jsonschema uses) lets "$" match before a final newline; ECMA's, which JSON schema
    # means, does not, and neither does the check: the values above hold no newlines.
    return jsonschema.Draft202012Validator(schema).is_valid(value)


@pytest.mark.parametrize("name", SHAPES)
def test_check_and_schema_accept_the_same_values(name):
    shape = SHAPES[name]
    schema = shape.schema(CTX)
    jsonschema.Draft202012Validator.check_schema(schema)

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_values(shape) | _near(shape))
    def agree(value):
        assert _check_says(shape, value) == _schema_says(schema, value), value

    agree()


def test_valid_examples_pass_both_ways():
    """The random values above are mostly invalid; these are real requests' fields, valid both ways."""
    examples = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}, "index": 0}
                ],
            },
            {"role": "tool", "content": "22C", "tool_call_id": "c1"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        ],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "object"}},
        },
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi", "annotations": []}]}],
        "text.format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}},
        "stop": ["ab", "c"],
        "bad_words": "x",
    }
    ctx = SchemaContext(RequestLimits(max_messages=4))
    for name, value in examples.items():
        shape = SHAPES[name]
        shape.check(value, name, ctx)
        jsonschema.validate(value, shape.schema(ctx))


@pytest.mark.parametrize(
    "name, value, param",
    [
        ("messages", [{"role": "user", "content": "x", "tool_call_id": "c"}], "messages[0].tool_call_id"),
        ("messages", [{"role": "user"}], "messages[0].content"),
        ("messages", [{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ("tools", [{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ("input", [{"type": "file_search_call"}], "input[0].type"),
        ("input", [{"type": "function_call_output", "output": "o"}], "input[0].call_id"),
        ("stop", ["a", "b", "c"], "stop"),
    ],
)
def test_errors_name_the_innermost_field(name, value, param):
    with pytest.raises(APIError) as e:
        SHAPES[name].check(value, name, CTX)
    assert e.value.param == param
