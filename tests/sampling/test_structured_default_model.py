"""Structured output on the default SmolLM2 model: 20 different JSON schemas, a regex and a choice request,
all at once beside unconstrained requests; every structured answer parses and validates."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.sampling_params import StructuredOutputsParams

NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city and its country",
        {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    ),
    (
        "a traffic light colour",
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "yellow", "green"]}},
            "required": ["color"],
        },
    ),
    ("three primes", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}),
    (
        "a book",
        {
            "type": "object",
            "properties": {"title": NAME, "author": NAME, "year": {"type": "integer"}},
            "required": ["title", "author", "year"],
        },
    ),
    (
        "a yes/no answer: is water wet?",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "a point in 2D",
        {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
        },
    ),
    (
        "a user with an address",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "address": {
                    "type": "object",
                    "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                },
            },
            "required": ["name", "address"],
        },
    ),
    (
        "two fruits",
        {
            "type": "object",
            "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 2}},
            "required": ["fruits"],
        },
    ),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}),
    (
        "a product with a price",
        {
            "type": "object",
            "properties": {"product": NAME, "price": {"type": "number", "minimum": 0}},
            "required": ["product", "price"],
        },
    ),
    (
        "a temperature reading",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                "unit": {"const": "C"},
            },
            "required": ["celsius", "unit"],
        },
    ),
    (
        "a team of two people",
        {
            "type": "object",
            "properties": {
                "team": {
                    "type": "array",
                    "maxItems": 2,
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "role": {"enum": ["lead", "dev"]}},
                        "required": ["name", "role"],
                    },
                }
            },
            "required": ["team"],
        },
    ),
    (
        "a planet",
        {
            "type": "object",
            "properties": {
                "planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]},
                "moons": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["planet", "moons"],
        },
    ),
    (
        "an RGB colour",
        {
            "type": "object",
            "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
            "required": ["r", "g", "b"],
        },
    ),
    (
        "a movie rating",
        {
            "type": "object",
            "properties": {"movie": NAME, "stars": {"enum": [1, 2, 3, 4, 5]}},
            "required": ["movie", "stars"],
        },
    ),
    (
        "a nested config",
        {
            "type": "object",
            "properties": {
                "server": {
                    "type": "object",
                    "properties": {"host": NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
                    "required": ["host", "port"],
                },
                "debug": {"type": "boolean"},
            },
            "required": ["server", "debug"],
        },
    ),
    (
        "a list of up to 3 tags",
        {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    ),
    (
        "an email address",
        {
            "type": "object",
            "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
            "required": ["email"],
        },
    ),
    (
        "an animal and whether it can fly",
        {
            "type": "object",
            "properties": {
                "animal": NAME,
                "can_fly": {"type": "boolean"},
                "legs": {"type": "integer", "minimum": 0, "maximum": 8},
            },
            "required": ["animal", "can_fly", "legs"],
        },
    ),
]


@pytest.fixture(scope="module")
def results():
    async def main():
        async with AsyncEngine(
            EngineArgs(model="default", max_model_len=1024, max_num_batched_tokens=1024)
        ) as eng:
            # xgrammar's tables are built on a thread during start(), not on the loop by the first request,
            # and are done when it returns: a build still running took the cores from the first step
            # (+0.3 s).
            assert eng._structured_build.done()
            prebuilt = eng._structured_build.result()
            assert prebuilt is not None

            def ask(text: str) -> list[dict]:
                return [{"role": "user", "content": text}]

            json_handles = [
                eng.chat(
                    ask(f"Reply in JSON with {what}. The schema is {json.dumps(schema)}"),
                    SamplingParams(
                        temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=schema)
                    ),
                )
                for what, schema in SCHEMAS
            ]
            regex = eng.chat(
                ask("Give me a US phone number."),
                SamplingParams(
                    temperature=0,
                    max_tokens=20,
                    structured_outputs=StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
                ),
            )
            choice = eng.chat(
                ask("Is Paris in France? Answer yes or no."),
                SamplingParams(
                    temperature=0,
                    max_tokens=5,
                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                ),
            )
            # JSON mode (OpenAI's json_object) means an object: "Say hi" once gave `[null]`.
            json_object = eng.chat(
                ask("Say hi"),
                SamplingParams(
                    temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json_object=True)
                ),
            )
            plain = [
                eng.chat(ask(q), SamplingParams(temperature=0.7, seed=i, max_tokens=40))
                for i, q in enumerate(
                    [
                        "Tell me a joke.",
                        "What is 2+2?",
                        "Name a colour.",
                        "Write a haiku about rain.",
                        "Say hello.",
                        "List three animals.",
                    ]
                )
            ]
            outs = await asyncio.gather(*json_handles, regex, choice, json_object, *plain)
            assert eng._structured is prebuilt
            assert eng.kv_cache_usage() == 0.0
            return outs

    return asyncio.run(asyncio.wait_for(main(), 300))


def test_twenty_json_schemas_parse_and_validate(results):
    for (what, schema), out in zip(SCHEMAS, results[:20], strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (what, c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_and_choice(results):
    regex, choice = results[20].outputs[0], results[21].outputs[0]
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", regex.text) and regex.finish_reason == "stop"
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"


def test_json_object_is_an_object(results):
    c = results[22].outputs[0]
    assert c.finish_reason == "stop", c.text
    assert isinstance(json.loads(c.text), dict), c.text


def test_unconstrained_requests_alongside(results):
    for out in results[23:]:
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length") and c.text
