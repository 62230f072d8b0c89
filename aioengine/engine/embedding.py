"""AsyncEngine.embed()'s rules: the input shapes OpenAI's API takes, `dimensions` (truncate, then
renormalize), and the vector each finished request gives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from aioengine.errors import InvalidRequestError, RequestAbortedError
from aioengine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

if TYPE_CHECKING:
    pass

EmbedInputs = list[str] | list[list[int]] | list[str | list[int]]  # several inputs: a list out
EmbedInput = str | list[int] | EmbedInputs


def split_inputs(inputs: object) -> tuple[list[str | list[int]], bool]:
    """(the prompts, whether ``inputs`` was one prompt): a string, token ids, or a list of either."""
    if isinstance(inputs, str):
        return [inputs], True
    if not isinstance(inputs, list | tuple) or not inputs:
        raise InvalidRequestError(
            "input must be a non-empty string, a list of token ids, or a non-empty list of either",
            param="input",
        )
    if all(type(t) is int for t in inputs):
        return [list(inputs)], True
    prompts: list[str | list[int]] = []
    for i, p in enumerate(inputs):
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list | tuple) and all(type(t) is int for t in p):
            prompts.append(list(p))
        else:
            raise InvalidRequestError(f"input[{i}] must be a string or a list of token ids", param="input")
    return prompts, False


def check_dimensions(dimensions: int | None, size: int) -> None:
    if dimensions is not None and (type(dimensions) is not int or not 1 <= dimensions <= size):
        raise InvalidRequestError(
            f"dimensions must be an integer from 1 to the model's embedding size ({size}), "
            f"got {dimensions!r}",
            param="dimensions",
        )


def embedding_output(out: RequestOutput, vector: Any, dimensions: int | None) -> EmbeddingRequestOutput:
    """The finished request ``out``'s EmbeddingRequestOutput: its unit vector, cut to ``dimensions`` and
    renormalized (Matryoshka-style, as OpenAI's `dimensions`)."""
    if vector is None:
        reason = out.outputs[0].finish_reason if out.outputs else None
        raise RequestAbortedError(f"the embedding request {out.request_id} ended without a vector ({reason})")
    v = np.asarray(vector, dtype=np.float32)
    if dimensions is not None and dimensions < len(v):
        v = v[:dimensions]
        norm = float(np.linalg.norm(v))
        if norm > 0:
            v = v / norm
    return EmbeddingRequestOutput(
        out.request_id,
        out.prompt_token_ids,
        EmbeddingOutput(v.tolist()),
        True,
        out.num_cached_tokens,
        out.metrics,
    )
