"""The detokenizer's fast path: the tokenizers library's decode, only where it matches transformers'."""

from __future__ import annotations

import random

import pytest

from aioengine.model_files import resolve_model
from aioengine.tokenizer import IncrementalDetokenizer, load_tokenizer, raw_decoder


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(resolve_model("default")))


def _samples(tokenizer, n=200, seed=0):
    """Random id runs: ordinary tokens, special tokens and byte-level pieces of multi-byte characters."""
    rng = random.Random(seed)
    special = list(tokenizer.all_special_ids)
    pieces = tokenizer("héllo → 世界 🎉 <|im_start|> done", add_special_tokens=False)["input_ids"]
    for _ in range(n):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 12))]
        ids[rng.randint(0, len(ids)) : 0] = rng.sample(special, min(2, len(special)))
        ids[rng.randint(0, len(ids)) : 0] = pieces[rng.randint(0, len(pieces)) :]
        yield ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_raw_decoder_returns_what_transformers_decode_does(tokenizer, skip_special_tokens):
    raw = raw_decoder(tokenizer)
    assert raw is not None, "the default model's fast tokenizer should take the fast path"
    for ids in _samples(tokenizer):
        assert raw(ids, skip_special_tokens) == tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


def test_detokenizer_text_is_the_same_on_both_paths(tokenizer, monkeypatch):
    prompt = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    streams = list(_samples(tokenizer, n=40, seed=1))

    def run() -> list[str]:
        texts = []
        for stream in streams:
            detok = IncrementalDetokenizer(tokenizer, prompt, stop=["ab"])
            texts.append(
                "".join(detok.add_tokens([t], finished=False) for t in stream)
                + detok.add_tokens([], finished=True)
                + repr(detok.stop_reason)
            )
        return texts

    fast = run()
    monkeypatch.setattr("aioengine.tokenizer.raw_decoder", lambda tok: None)
    assert run() == fast


def test_tokenizers_that_rewrite_their_text_keep_transformers_decode(tokenizer):
    path = str(resolve_model("default"))
    cleaned = load_tokenizer(path)
    cleaned.clean_up_tokenization_spaces = True
    assert raw_decoder(cleaned) is None

    class Custom(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return "x" * len(token_ids)

    custom = load_tokenizer(path)
    custom.__class__ = Custom
    assert raw_decoder(custom) is None
    assert IncrementalDetokenizer(custom, [], stop=[]).add_tokens([5, 6], finished=True) == "xx"
