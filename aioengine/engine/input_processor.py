"""A request's input checked before it reaches the scheduler: its prompt ids, its length against the model and
the KV cache, and the SamplingParams it runs with (vLLM's input processor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import SamplingParams


def prompt_ids(
    prompt: object, encode: Callable[[str], list[int]], vocab_size: int, max_model_len: int, param: str
) -> tuple[str | None, list[int]]:
    """(the prompt's text if it is one, its token ids), or InvalidRequestError naming ``param``."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("The prompt cannot be empty.", param=param)
        try:
            return prompt, list(encode(prompt))
        except TypeError as e:  # the tokenizers library's answer to text with no UTF-8 (a lone surrogate)
            raise InvalidRequestError(f"The prompt cannot be tokenized: {e}", param=param) from None
    if isinstance(prompt, list | tuple):
        ids = list(prompt)
        check_prompt_length(len(ids), max_model_len, param)  # before scanning millions of ids on the loop
        if not all(type(t) is int and 0 <= t < vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}).", param=param)
        return None, ids
    raise InvalidRequestError("prompt must be a string or a list of token ids.", param=param)


def check_prompt_length(num_prompt: int, max_model_len: int, param: str = "prompt") -> None:
    if num_prompt == 0:
        raise InvalidRequestError("The prompt cannot be empty.", param=param)
    if num_prompt >= max_model_len:
        raise InvalidRequestError(
            f"The prompt is {num_prompt} tokens long, which is not shorter than this model's maximum "
            f"context length of {max_model_len} tokens.",
            param=param,
            code="context_length_exceeded",
        )


def request_params(
    params: SamplingParams,
    num_prompt: int,
    max_model_len: int,
    kv_capacity_tokens: int,
    tokenizer: Any,
    vocab_size: int,
) -> SamplingParams:
    """``params`` as the request runs them: max_tokens filled in to the context's end, bad words as token
    ids; InvalidRequestError when prompt and completion outgrow the context or the whole KV cache."""
    check_prompt_length(num_prompt, max_model_len)
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt
    elif num_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if num_prompt + max_tokens > kv_capacity_tokens:
        raise InvalidRequestError(
            f"The request needs up to {num_prompt + max_tokens} tokens of KV cache, more than the whole "
            f"cache holds ({kv_capacity_tokens} tokens).",
            param="max_tokens",
        )
    if params.max_tokens is None:
        params = replace(params, max_tokens=max_tokens)
    if params.bad_words:
        params = replace(params, bad_words_token_ids=params.bad_words_to_token_ids(tokenizer))
    params.verify_vocab(vocab_size)
    return params
