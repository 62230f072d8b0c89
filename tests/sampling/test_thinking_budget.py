"""The thinking budget: at most N tokens in the think block, then "</think>" is forced token by token; the
block's tags are found in the text whatever tokens spell them; a request's own grammar runs inside it; and
through the engine, concurrent requests each close their block at their own budget."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.errors import InvalidRequestError
from aioengine.model.files import resolve_model
from aioengine.sampling_params import StructuredOutputsParams
from aioengine.structured.manager import StructuredOutputManager

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model("default"))


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, 49152, EOS)


def _row(manager, grammar) -> np.ndarray:
    return manager.grammar_bitmask(["r"], [grammar]).bitmask[0]


def _allowed(row: np.ndarray) -> list[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def _feed(budget, ids) -> None:
    for t in ids:
        assert budget.accept_token(t)


def test_deepseek_r1_counts_from_the_start_and_forces_the_closing_tag(manager, tokenizer):
    b = manager.thinking_budget(3, "deepseek_r1", None)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # this tokenizer spells it in pieces: each is forced in turn
    words = tokenizer.encode(" one two three four", add_special_tokens=False)
    assert len(_allowed(_row(manager, b))) == 49152  # free while under budget
    _feed(b, words[:3])
    for t in end:
        assert _allowed(_row(manager, b)) == [t]
        assert b.accept_token(t)
    assert len(_allowed(_row(manager, b))) == 49152 and not b.is_terminated()  # the answer is free
    _feed(b, words)  # and never counted


def test_qwen3_waits_for_the_block_and_a_closed_block_is_never_forced(manager, tokenizer):
    b = manager.thinking_budget(4, "qwen3", None)
    _feed(b, tokenizer.encode("Sure, no block yet and a long answer", add_special_tokens=False))
    assert b.state == "idle" and len(_allowed(_row(manager, b))) == 49152
    _feed(b, tokenizer.encode(" <think>ab", add_special_tokens=False))  # the tag in pieces, text after it
    assert b.state == "thinking"
    # the budget runs out inside the model's own closing tag ("</", "think" are its 3rd and 4th tokens):
    # only the missing ">" is forced, not a second tag
    _feed(b, tokenizer.encode("c</think", add_special_tokens=False))
    assert b.state == "closing" and _allowed(_row(manager, b)) == tokenizer.encode(
        ">", add_special_tokens=False
    )
    _feed(b, tokenizer.encode("> done", add_special_tokens=False))
    assert b.state == "done" and len(_allowed(_row(manager, b))) == 49152


def test_a_budget_of_zero_closes_the_block_at_once(manager, tokenizer):
    b = manager.thinking_budget(0, "deepseek_r1", None)
    assert _allowed(_row(manager, b)) == tokenizer.encode("</think>", add_special_tokens=False)[:1]
    assert not b.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])  # anything else: refused


def test_the_requests_own_grammar_runs_inside(manager, tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"], reasoning="deepseek_r1")
    b = manager.thinking_budget(2, "deepseek_r1", manager.new_grammar(manager.compile(spec)))
    _feed(b, tokenizer.encode(" hmm hmm", add_special_tokens=False)[:2])
    for t in tokenizer.encode("</think>", add_special_tokens=False):
        assert _allowed(_row(manager, b)) == [t]  # the forced token, which the grammar also allows
        assert b.accept_token(t)
    allowed = _allowed(_row(manager, b))
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed and len(allowed) < 1000
    _feed(b, [*tokenizer.encode("no", add_special_tokens=False), EOS])
    assert b.is_terminated()


def test_bad_budgets_are_refused():
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    with pytest.raises(InvalidRequestError, match="reasoning_parser"):
        SamplingParams(thinking_token_budget=3, reasoning_parser="o1")


def test_the_engine_closes_each_block_at_its_budget(tokenizer):
    """Four concurrent requests (async scheduling, a batch queue of two): each request's reasoning ends
    exactly at its budget with the forced tag; a request without one is as it is alone."""
    end = tokenizer.encode("</think>", add_special_tokens=False)
    ask = [{"role": "user", "content": "Name three fruits."}]

    async def main():
        async with AsyncEngine(EngineArgs(model="default", num_threads=1)) as engine:
            alone = await engine.chat(ask, SamplingParams(temperature=0, max_tokens=16))
            budgets = [1, 4, 7, None]
            outs = await asyncio.gather(
                *(
                    engine.chat(
                        ask,
                        SamplingParams(
                            temperature=0,
                            max_tokens=16,
                            thinking_token_budget=b,
                            reasoning_parser="deepseek_r1",
                        ),
                    )
                    for b in budgets
                )
            )
            return alone, budgets, outs

    alone, budgets, outs = asyncio.run(main())
    for b, out in zip(budgets, outs, strict=True):
        ids = list(out.outputs[0].token_ids)
        if b is None:
            assert ids == list(alone.outputs[0].token_ids)
            continue
        assert ids[b : b + len(end)] == end, (b, ids)
        assert ids[:b] == list(alone.outputs[0].token_ids)[:b]  # free until the budget
        assert "</think>" in out.outputs[0].text and len(ids) > b + len(end)  # the answer follows
