"""Build a model from a local Hugging Face directory, stream its safetensors; KV cache shapes and sizes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from aioengine.gpu.backend import REFERENCE_OPS, Ops
from aioengine.gpu.models import get_model_class
from aioengine.gpu.models.llama import LlamaForCausalLM, head_dim_of, num_kv_heads_of
from aioengine.gpu.parallel import TPShard, shard_config, shard_of, shard_reader
from aioengine.gpu.random_model import build_random_model, is_random_model
from aioengine.model import float_checkpoint
from aioengine.model.checkpoint import safetensors_files


def iterate_weights(
    files: list[str], shard: TPShard | None = None, head_dim: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so peak memory stays near one tensor; under tensor
    parallelism only this rank's rows or columns of each tensor are read from the file."""
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if shard is None:
                    yield name, f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                shape = tuple(part.get_shape())

                def read(i: tuple[slice, ...] | None, p: Any = part) -> torch.Tensor:
                    return p[i] if i else p[:]

                yield name, shard_reader(name, shape, read, shard, head_dim)


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: Any = "cpu",
    ops: Ops = REFERENCE_OPS,
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """(model in eval mode on ``device`` with ``dtype`` weights, its layers calling ``ops``, its HF config).
    Never uses the network.

    ``random:NAME`` builds a random-weight model of a known shape on the device instead (no files).
    """
    tp = ops.tp  # tensor parallelism: the model is this rank's part, its config the rank's view
    if is_random_model(os.fspath(path)):
        return build_random_model(os.fspath(path), dtype, device, ops=ops)
    hf_config = AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
    model_cls = get_model_class(hf_config)
    files = safetensors_files(path)
    # a GGUF mixture's experts converted as block codes (model/gguf_codes.py): the model holds them so
    hf_config.expert_block_codes = float_checkpoint.has_codes(Path(path))
    shard = None
    if tp is not None:
        shard = shard_of(hf_config, tp.rank, tp.size)
        hf_config = shard_config(hf_config, shard)
    with torch.no_grad():
        model = model_cls(hf_config, dtype=dtype, device=device, ops=ops)
        # copy_ casts dtype and device
        model.load_weights(iterate_weights(files, shard, head_dim_of(hf_config)))
    model.requires_grad_(False)
    return model.eval(), hf_config


def kv_cache_shape(model_config: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """One layer's cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    hf = getattr(model_config, "hf_config", model_config)
    return (2, num_blocks, block_size, num_kv_heads_of(hf), head_dim_of(hf))


def kv_cache_bytes_per_block(
    model_config: Any, block_size: int, dtype: torch.dtype, num_tensors: int | None = None
) -> int:
    """Bytes one block id costs (for sizing ``num_blocks`` from a memory budget): a slot in each of the
    ``num_tensors`` cache tensors (default: one per layer)."""
    hf = getattr(model_config, "hf_config", model_config)
    per_layer = 2 * block_size * num_kv_heads_of(hf) * head_dim_of(hf)
    n = hf.num_hidden_layers if num_tensors is None else num_tensors
    return per_layer * n * torch.empty((), dtype=dtype).element_size()
