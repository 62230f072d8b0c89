"""Structured outputs after a think block (StructuredOutputsParams.reasoning, set by the HTTP layer under
--reasoning-parser): the block's text is free up to the first </think>, the constraint covers the answer
after it, and the output may not end inside the block."""

from __future__ import annotations

import pytest

from aioengine.errors import InvalidRequestError
from aioengine.model.files import resolve_model
from aioengine.sampling_params import StructuredOutputsParams
from aioengine.structured.manager import StructuredOutputManager

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
EOS = 2


@pytest.fixture(scope="module")
def manager():
    from transformers import AutoTokenizer

    return StructuredOutputManager(AutoTokenizer.from_pretrained(resolve_model("default")), 49152, EOS)


def _accepts(manager, params, text: str) -> tuple[bool, bool]:
    """(the grammar takes ``text``, and may then end: EOS allowed next)."""
    g = manager.new_grammar(manager.compile(params))
    if not g.matcher.accept_string(text):
        return False, False
    row = manager.grammar_bitmask(["r"], [g]).bitmask[0]
    return True, bool((int(row[EOS // 32]) >> (EOS % 32)) & 1)


@pytest.mark.parametrize(
    ("reasoning", "text", "taken", "may_end"),
    [
        ("qwen3", '<think>\nhmm: a < b, </thin and <think></think>\n\n{"a": 1}', True, True),
        ("qwen3", '{"a": 1}', True, True),  # no think block (enable_thinking false)
        ("qwen3", '  <think><</think>{"a": 2}', True, True),  # a "<" right before the closing tag
        ("qwen3", "<think>free text, not JSON", True, False),  # still thinking: may not end here
        ("qwen3", "<think>x</think>not json", False, False),  # the answer is constrained
        ("qwen3", '<think>a</think></think>{"a": 1}', False, False),  # the block ends at the first tag
        ("qwen3", 'not json{"a": 1}', False, False),
        ("deepseek_r1", 'the template opened it</think>{"a": 3}', True, True),
        ("deepseek_r1", '{"a": 3}', True, False),  # JSON-looking text is still the think block's
        ("deepseek_r1", "thinking</think>nope", False, False),
    ],
)
def test_the_constraint_starts_after_the_think_block(manager, reasoning, text, taken, may_end):
    params = StructuredOutputsParams(json=SCHEMA, reasoning=reasoning)
    assert _accepts(manager, params, text) == (taken, may_end)


def test_every_kind_of_constraint_follows_the_block(manager):
    for params, answer in [
        (StructuredOutputsParams(regex="[0-9]{3}", reasoning="qwen3"), "123"),
        (StructuredOutputsParams(choice=["yes", "no"], reasoning="qwen3"), "no"),
        (StructuredOutputsParams(grammar='root ::= "ok"', reasoning="qwen3"), "ok"),
        (StructuredOutputsParams(json_object=True, reasoning="qwen3"), "{}"),
    ]:
        assert _accepts(manager, params, "<think>why</think>" + answer) == (True, True)
        assert _accepts(manager, params, "<think>why</think>" + answer + "!")[0] is False


def test_without_reasoning_the_constraint_covers_everything(manager):
    plain = StructuredOutputsParams(json=SCHEMA)
    assert _accepts(manager, plain, '{"a": 1}') == (True, True)
    assert _accepts(manager, plain, '<think>x</think>{"a": 1}')[0] is False
    assert plain.cache_key() != StructuredOutputsParams(json=SCHEMA, reasoning="qwen3").cache_key()


def test_an_unknown_reasoning_kind_is_refused(manager):
    with pytest.raises(InvalidRequestError, match="reasoning must be one of qwen3, deepseek_r1"):
        manager.compile(StructuredOutputsParams(json=SCHEMA, reasoning="o1"))
