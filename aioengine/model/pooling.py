"""Embeddings: the pooling a checkpoint declares, or the one EngineArgs asks for.

An embedding request is prefill-only work: the scheduler runs its prompt in chunks like any other, the
runner pools the final (normed) hidden states of its tokens into one vector, normalized to unit length,
and the request finishes without sampling.
- ``last``: the last prompt token's hidden state (decoder-only embedders: Qwen3-Embedding, e5-mistral).
  A prefix-cache hit still serves every token before it.
- ``mean``: the mean over all prompt tokens, and ``cls``: the first token's. Both need every position
  computed by the request itself, so they read nothing from the prefix cache (they still fill it).
"""

from __future__ import annotations

import json
import os

from aioengine.config import DEFAULT_POOLING, POOLING_TYPES

# sentence-transformers' 1_Pooling/config.json flags -> ours
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


class PoolingConfigError(ValueError):
    """The checkpoint declares a pooling this engine does not run."""


def pooling_of_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json's Pooling module), or None.

    Raises PoolingConfigError for a mode other than last-token, mean or CLS (max, weighted mean...).
    """
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    with open(os.path.join(path, pooling.get("path", ""), "config.json")) as f:
        config = json.load(f)
    on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
    if len(on) == 1 and on[0] in _ST_MODES:
        return _ST_MODES[on[0]]
    raise PoolingConfigError(
        f"{path}: the checkpoint's pooling ({', '.join(on) or 'none'}) is not one this engine runs "
        f"({', '.join(POOLING_TYPES)}); choose one with --pooling"
    )


def resolve_pooling(requested: str | None, path: str) -> str:
    """``requested`` (EngineArgs.pooling) if set, else the checkpoint's, else last-token."""
    if requested is not None:
        return requested
    if os.path.isdir(path):
        declared = pooling_of_checkpoint(path)
        if declared is not None:
            return declared
    return DEFAULT_POOLING
