"""The one entry point from what the user typed (EngineArgs.model) to what the runner loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aioengine.config import EngineArgs
from aioengine.model.checkpoint import RANDOM_PREFIX, read_config
from aioengine.model.files import resolve_model
from aioengine.model.random_gguf import gguf_alias


@dataclass(frozen=True, slots=True)
class ModelSource:
    path: str  # a Hugging Face-style folder (a GGUF converted once into the cache), or random:NAME
    name: str  # the name it is served under
    config: dict[str, Any]  # the checkpoint's probe: context length, vocabulary, EOS, generation config


def resolve_source(args: EngineArgs) -> ModelSource:
    """Find (and convert once) the checkpoint, and read its config; blocking, so callers run it on a thread.

    Raises ModelNotFoundError for a name that is no checkpoint, GGUFError for a damaged or unsupported file.
    """
    gguf = gguf_alias(args.model)
    if gguf is not None:  # random weights of a known shape, written as a GGUF file
        path = str(resolve_model(gguf))
    elif args.model.startswith(RANDOM_PREFIX):  # random weights of a known shape: no files
        path = args.model
    else:
        path = str(resolve_model(args.model))
    name = args.served_model_name or (args.model if args.model == "default" else args.model.rstrip("/"))
    return ModelSource(path, name, read_config(path))
