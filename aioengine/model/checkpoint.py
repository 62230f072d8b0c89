"""What the engine reads from a checkpoint around loading it: the config probe (context length, vocabulary,
EOS), the default sampling parameters of its generation config, and its tokenizer."""

from __future__ import annotations

import json
import os
from typing import Any

from aioengine.config import EngineArgs
from aioengine.model.tokenizer import NullTokenizer, load_tokenizer, read_chat_template

RANDOM_PREFIX = "random:"  # aioengine.gpu.random_model.RANDOM_PREFIX (not imported here: it needs torch)


SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def safetensors_files(path: str | os.PathLike[str]) -> list[str]:
    """The checkpoint's safetensors files: the shards of the index, or the single file."""
    path = os.fspath(path)
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    single = os.path.join(path, SAFETENSORS_SINGLE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {path}")


def load_engine_tokenizer(args: EngineArgs, model_path: str, vocab_size: int) -> Any:
    """The tokenizer directory's, else the model's; none (a NullTokenizer) with skip_tokenizer_init, or for
    a random-weight model given no tokenizer."""
    if args.skip_tokenizer_init or (args.tokenizer is None and model_path.startswith(RANDOM_PREFIX)):
        return NullTokenizer(vocab_size)
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    if args.chat_template is not None:
        tokenizer.chat_template = read_chat_template(args.chat_template)
    return tokenizer


# The sampling fields vLLM takes from a generation_config.json (its "auto" default).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_config(directory: str) -> dict:
    """The directory's generation_config.json, or {} without one."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def generation_defaults(source: str, model_generation_config: dict) -> dict:
    """Default sampling parameters from a generation config: the model's (``source`` "auto", as read_config
    found it), none ("vllm"), or the file in the directory ``source``. Only the fields the file sets."""
    if source == "vllm":
        return {}
    if source == "auto":
        config = model_generation_config
    elif os.path.isfile(os.path.join(source, "generation_config.json")):
        config = _generation_config(source)
    else:
        raise ValueError(
            f"generation_config must be auto, vllm or a directory with a generation_config.json; "
            f"got {source!r}"
        )
    return {
        k: config[k]
        for k in _GENERATION_DEFAULTS
        if isinstance(config.get(k), int | float) and not isinstance(config.get(k), bool)
    }


def read_config(path: str) -> dict:
    """What start() needs before the weights load: context length, vocabulary, EOS, and the generation
    config (its sampling defaults)."""
    if path.startswith(RANDOM_PREFIX):
        from aioengine.gpu.random_model import random_config

        cfg = random_config(path)
        return {
            "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size,
            "eos_token_id": cfg.eos_token_id,
            "generation_config": {},
        }
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    generation = _generation_config(path)
    eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    text_cfg = cfg.get("text_config", cfg)
    return {
        "max_position_embeddings": text_cfg.get("max_position_embeddings", 2048),
        "vocab_size": text_cfg["vocab_size"],
        "eos_token_id": eos,
        "generation_config": generation,
    }
