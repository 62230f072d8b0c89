"""AsyncEngine.embed() (EmbedMixin) and its rules: the input shapes OpenAI's API takes, `dimensions`
(truncate, then renormalize), and the vector each finished request gives."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from aioengine.errors import InvalidRequestError, RequestAbortedError
from aioengine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from aioengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from aioengine.engine.client import PrecompiledGrammar
    from aioengine.engine.handle import GenerateHandle

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


class EmbedMixin:
    """embed() for AsyncEngine: each input is a request of the engine's own, prefill-only and pooled."""

    pooling: str | None  # set by start(); None with _pooling_error when the checkpoint's is unknown
    _pooling_error: str
    embedding_size: int

    if TYPE_CHECKING:  # AsyncEngine's

        def _check_alive(self) -> None: ...

        def _prompt_ids(self, prompt: object, param: str = "prompt") -> tuple[str | None, list[int]]: ...

        def _add(
            self,
            prompt: str | None,
            prompt_ids: list[int],
            params: SamplingParams,
            request_id: str | None,
            priority: int,
            cache_salt: str | None,
            grammar: PrecompiledGrammar | None = None,
            pooling: str | None = None,
        ) -> GenerateHandle: ...

    @overload
    async def embed(
        self,
        input: str | list[int],
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput: ...

    @overload
    async def embed(
        self,
        input: EmbedInputs,
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> list[EmbeddingRequestOutput]: ...

    async def embed(
        self,
        input: EmbedInput,
        *,
        dimensions: int | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EmbeddingRequestOutput | list[EmbeddingRequestOutput]:
        """Embed a string or token ids (one output), or a list of either (a list, in order): the model's
        final hidden states pooled (``self.pooling``) and normalized, then cut to ``dimensions`` and
        renormalized if given. Prefill-only work in the same steps as generation. Raises
        InvalidRequestError, EngineDeadError, or RequestAbortedError when aborted before its vector."""
        self._check_alive()
        if self.pooling is None:
            raise InvalidRequestError(self._pooling_error, param="model")
        prompts, single = split_inputs(input)
        check_dimensions(dimensions, self.embedding_size)
        params = SamplingParams(max_tokens=1)  # nothing is sampled: it sizes the admission checks
        handles: list[GenerateHandle] = []
        try:
            for i, p in enumerate(prompts):
                text, ids = self._prompt_ids(p, "input")
                rid = request_id if single or request_id is None else f"{request_id}-{i}"
                handles.append(self._add(text, ids, params, rid, priority, None, pooling=self.pooling))
        except BaseException:
            for h in handles:
                h.abort()
            raise
        outs = await asyncio.gather(*handles)
        results = [embedding_output(o, h.embedding, dimensions) for h, o in zip(handles, outs, strict=True)]
        return results[0] if single else results
