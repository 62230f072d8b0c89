"""SamplingParams validation: vLLM's messages and limits, typed errors with the offending parameter."""

from __future__ import annotations

import pytest

from aioengine import InvalidRequestError, SamplingParams
from aioengine.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize(
    "kw,param,message",
    [
        (dict(temperature=-0.1), "temperature", "temperature must be non-negative, got -0.1."),
        (dict(top_p=0.0), "top_p", "top_p must be in (0, 1], got 0.0."),
        (dict(top_k=-2), "top_k", "top_k must be 0"),
        (dict(min_p=1.5), "min_p", "min_p must be in [0, 1], got 1.5."),
        (dict(presence_penalty=2.5), "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5."),
        (dict(frequency_penalty=-3), "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3."),
        (
            dict(repetition_penalty=0.0),
            "repetition_penalty",
            "repetition_penalty must be greater than zero, got 0.0.",
        ),
        (
            dict(logprobs=21),
            "logprobs",
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (dict(logprobs=-1), "logprobs", "logprobs must be non-negative, got -1."),
        (
            dict(prompt_logprobs=21),
            "prompt_logprobs",
            "Requested prompt logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            dict(min_tokens=5, max_tokens=4),
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=4",
        ),
        (dict(n=2, temperature=0), "n", "n must be 1 when using greedy sampling"),
        (dict(allowed_token_ids=[]), "allowed_token_ids", "allowed_token_ids is not None and empty!"),
        (dict(logit_bias={"x": 1}), "logit_bias", "logit_bias keys must be token ids"),
        (dict(logit_bias={1: "a"}), "logit_bias", "logit_bias values must be numbers"),
        (dict(bad_words=[1]), "bad_words", "bad_words must be a list of strings."),
        (dict(stop=[""]), "stop", "stop cannot contain an empty string."),
    ],
)
def test_invalid_values_raise_with_vllms_message(kw, param, message):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and message in str(e.value)


def test_limits_are_inclusive_and_penalties_above_two_are_allowed_like_vllm():
    SamplingParams(logprobs=20, prompt_logprobs=20, presence_penalty=2, frequency_penalty=-2)
    assert SamplingParams(repetition_penalty=3.0).repetition_penalty == 3.0
    assert SamplingParams(top_k=-1).top_k == 0


def test_vocab_checks_name_the_bad_ids():
    with pytest.raises(
        InvalidRequestError, match=r"token_id\(s\) \[100, -1\] in logit_bias contain out-of-vocab"
    ):
        SamplingParams(logit_bias={100: 1, -1: 1, 5: 2}).verify_vocab(100)
    with pytest.raises(InvalidRequestError, match="allowed_token_ids contains out-of-vocab token id!"):
        SamplingParams(allowed_token_ids=[1, 100]).verify_vocab(100)
    p = SamplingParams(bad_words=["x"])
    p.bad_words_token_ids = [[5, 200]]
    with pytest.raises(InvalidRequestError, match=r"following tokens were specified as bad: \[200\]"):
        p.verify_vocab(100)


def test_structured_outputs_need_exactly_one_kind():
    with pytest.raises(InvalidRequestError, match="only use one kind"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(InvalidRequestError, match="must use one kind"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="cannot be an empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="grammar cannot be an empty string"):
        StructuredOutputsParams(grammar="  ")
    with pytest.raises(InvalidRequestError, match="Invalid structured_outputs"):
        SamplingParams(structured_outputs={"jsonn": {}})
    p = SamplingParams(structured_outputs={"json_object": True})
    assert p.structured_outputs.kinds() == ["json_object"]
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json={"a": 2, "b": 1})
    assert a.cache_key() == b.cache_key() != StructuredOutputsParams(json={"a": 2}).cache_key()


class _WordTokenizer:
    vocab = {"bad": 1, " bad": 2, "very": 3, " very": 4, "worse": 5, " wor": 6, "se": 7}

    def encode(self, text, add_special_tokens=False):
        out, rest = [], text
        while rest:
            piece = max((p for p in self.vocab if rest.startswith(p)), key=len)
            out.append(self.vocab[piece])
            rest = rest[len(piece) :]
        return out


def test_bad_words_become_token_sequences_with_and_without_a_leading_space():
    ids = SamplingParams(bad_words=["bad", " worse"]).bad_words_to_token_ids(_WordTokenizer())
    # "bad" -> [1]; " bad" -> [2] (same length, other first token: kept); "worse" -> [5]; " worse" -> [6, 7]
    # has another length: dropped, as vLLM does
    assert ids == [[1], [2], [5]]


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"stop": 123}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"top_k": 10**30}, "top_k"),
        ({"temperature": 1e300}, "temperature"),
    ],
)
def test_wrong_types_and_sizes_are_typed_errors(kw, param):
    """Not a TypeError from deep inside, nor an overflow in an engine step: InvalidRequestError, naming it."""
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def _outside(r, kind):
    """A value just beyond each bound of the range r (int fields step by 1, floats by a little)."""
    step = 1 if kind is int else 1e-3
    out = []
    if r.lo is not None:
        out.append(r.lo if r.exclusive_lo else r.lo - step)
    if r.hi is not None:
        out.append(r.hi + step)
    return out


def test_one_source_for_the_sampling_bounds_sampling_params_and_openapi_agree():
    """sampling_params.BOUNDS is the one statement of the bounds: SamplingParams refuses just outside each
    and accepts each bound itself, and /openapi.json's chat schema states the same numbers."""
    from aioengine.http.openapi import openapi_spec
    from aioengine.sampling_params import BOUNDS

    base = dict(temperature=1.0, max_tokens=None)
    kinds = {
        name: int
        if name
        in (
            "n",
            "top_k",
            "max_tokens",
            "min_tokens",
            "seed",
            "logprobs",
            "prompt_logprobs",
            "thinking_token_budget",
        )
        else float
        for name in BOUNDS
    }
    for name, r in BOUNDS.items():
        for value in _outside(r, kinds[name]):
            with pytest.raises(InvalidRequestError) as e:
                SamplingParams(**{**base, name: value})
            assert e.value.param == name, (name, value)
        for value in (r.lo, r.hi):
            if value is not None and not (value == r.lo and r.exclusive_lo):
                SamplingParams(**{**base, name: kinds[name](value)})

    props = openapi_spec("test")["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    http_names = {"max_tokens": ("max_tokens", "max_completion_tokens"), "logprobs": ("top_logprobs",)}
    for name, r in BOUNDS.items():
        for field in http_names.get(name, (name,)):
            if field not in props:
                continue  # prompt_logprobs: not a chat field
            schema = props[field]["anyOf"][0]
            lo_key = "exclusiveMinimum" if r.exclusive_lo else "minimum"
            assert schema.get(lo_key) == r.lo, field
            if name != "n":  # n's ceiling is the server's --request-limit max_n
                assert schema.get("maximum") == r.hi, field
