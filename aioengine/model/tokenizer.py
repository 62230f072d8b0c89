"""Tokenizer loading, chat templates, and the incremental detokenizer with stop strings."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aioengine.env import hf_offline
from aioengine.errors import InvalidRequestError

# Prompt tokens decoded with the output so that SentencePiece-style leading spaces come out right.
_PREFIX_CONTEXT = 6


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    with hf_offline():
        return AutoTokenizer.from_pretrained(path)


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file's contents, else the text itself; a template Jinja cannot parse is refused
    now (ValueError) rather than failing every chat request later."""
    template = value
    if "{" not in value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not a valid Jinja template: {e}") from None
    return template


class NullTokenizer:
    """For a model without a tokenizer (``random:NAME``): prompts are token ids, outputs have no text."""

    all_special_ids: list[int] = []
    eos_token_id = None
    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        raise InvalidRequestError("this model has no tokenizer: send the prompt as token ids", param="prompt")

    __call__ = encode

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return ""


# apply_chat_template's options that change how the rendered chat is encoded (or what is returned)
_ENCODING_OPTIONS = frozenset(
    {
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def apply_chat_template(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
) -> list[int]:
    """Token ids of a chat conversation; malformed messages raise InvalidRequestError."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError("each message must be an object with a 'role'", param="messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model's tokenizer has no chat template", param="messages")
    # transformers' tokenize=True renders the chat, then encodes it without adding special tokens: the same
    # two steps here, the second on the fast path, unless the caller passed options of that encoding
    encode = None if _ENCODING_OPTIONS & kwargs.keys() else raw_encoder(tokenizer)
    try:
        if encode is not None:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
            return encode(text, False)
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
    except Exception as e:  # jinja errors, or text with no UTF-8, from user content: the request is bad
        raise InvalidRequestError(f"could not apply the chat template: {e}", param="messages") from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _plain_backend(tokenizer: Any, base: tuple[str, ...], backend: tuple[str, ...]) -> Any:
    """The tokenizers library's Tokenizer behind a transformers fast ``tokenizer`` whose methods named in
    ``base`` (PreTrainedTokenizerBase's) and ``backend`` (TokenizersBackend's) are transformers' own; else
    None. Only then does calling the library directly return what the tokenizer's methods would."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or getattr(tokenizer, "_tokenizer", None) is None:
        return None
    if any(getattr(cls, m) is not getattr(PreTrainedTokenizerBase, m) for m in base) or any(
        getattr(cls, m) is not getattr(TokenizersBackend, m) for m in backend
    ):
        return None
    return tokenizer._tokenizer


def raw_decoder(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The tokenizers library's own ``decode(ids, skip_special_tokens)`` where it returns what
    ``tokenizer.decode`` would: a transformers fast tokenizer that overrides neither ``decode`` nor
    ``_decode`` and cleans up no spaces. The Python wrapper around it costs several times the decode itself,
    twice a token."""
    backend = _plain_backend(tokenizer, ("decode",), ("_decode",))
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None  # transformers may rewrite the text (or skip that for BPE, with a warning): keep its path
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


def raw_encoder(tokenizer: Any) -> Callable[[str, bool], list[int]] | None:
    """The tokenizers library's ids of one text (and the special tokens, if asked), where they are what
    ``tokenizer.encode(text, add_special_tokens=...)`` returns: a transformers fast tokenizer that overrides
    neither ``encode`` nor ``_encode_plus``, with no truncation or padding set on its backend. It skips the
    offsets transformers asks for and the wrapper around the call: about a third of a prompt's tokenizing,
    done on the loop."""
    backend = _plain_backend(tokenizer, ("encode",), ("_encode_plus",))
    if (
        backend is None
        or not hasattr(backend, "encode_batch_fast")
        or backend.truncation is not None
        or backend.padding is not None
    ):
        return None
    split = bool(getattr(tokenizer, "split_special_tokens", False))

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if backend.encode_special_tokens != split:  # transformers sets it per call: so does this
            backend.encode_special_tokens = split
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    return encode


class IncrementalDetokenizer:
    """Turns one completion's token stream into text deltas.

    Never emits a partial multi-byte character (the replacement char means "wait for more tokens"), and
    holds back the tail that could still become a stop string, so the stop string never reaches the user.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        context = prompt_token_ids[-_PREFIX_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # all decoded output text so far (after stop-string truncation)
        self.emitted = 0  # characters of self.text already returned to the user
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.stop_reason: str | None = None
        self._raw = raw_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._raw is not None:
            return self._raw(ids, self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int], finished: bool) -> str:
        """Append tokens; returns the new text to emit. Sets stop_reason when a stop string matched."""
        if self.stop_reason is None and new_token_ids:
            self.ids.extend(new_token_ids)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
                new_text = full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                start = len(self.text)
                self.text += new_text
                if self.stop:
                    self._check_stop_strings(start)
        if self.stop_reason is not None or finished:
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def _check_stop_strings(self, new_start: int) -> None:
        search_from = max(0, new_start - self.hold_back)
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stop_reason = s
