"""Random-weight models, named ``random:NAME``: real shapes, weights drawn on the device, no files.

Throughput does not depend on weight values, so ``random:llama-3.1-8b`` benchmarks an 8B model on a
machine without its checkpoint (no safetensors, no network), and ``random:tiny`` runs the same code
path on CPU in tests. Prompts are token ids (the model has no tokenizer; see ``NullTokenizer``).
"""

from __future__ import annotations

from typing import Any

import torch

RANDOM_PREFIX = "random:"

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "original_max_position_embeddings": 64},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def is_random_model(name: str | None) -> bool:
    return bool(name and name.startswith(RANDOM_PREFIX))


def random_config(name: str) -> Any:
    """The transformers ``LlamaConfig`` of ``random:NAME`` (or of a bare NAME)."""
    from transformers import LlamaConfig

    key = name.removeprefix(RANDOM_PREFIX)
    if key not in SHAPES:
        raise ValueError(
            f"unknown random model {name!r}; known: {', '.join(RANDOM_PREFIX + k for k in SHAPES)}"
        )
    return LlamaConfig(architectures=["LlamaForCausalLM"], **SHAPES[key])


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Weights ~ N(0, std) and norms ~ 1 + N(0, std), drawn where the parameters live."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        p.normal_(1.0 if "norm" in name else 0.0, std, generator=gen)


def build_random_model(
    name: str, dtype: torch.dtype, device: Any, seed: int = 0, ops: Any = None
) -> tuple[Any, Any]:
    """(our LlamaForCausalLM with random weights on ``device``, built with ``ops``, its HF config)."""
    from aioengine.gpu.backend import REFERENCE_OPS
    from aioengine.gpu.models.llama import LlamaForCausalLM

    config = random_config(name)
    tp = getattr(ops, "tp", None)
    if tp is not None:  # each rank draws its own part (throughput does not depend on the values)
        from aioengine.gpu.parallel import shard_config, shard_of

        config = shard_config(config, shard_of(config, tp.rank, tp.size))
        seed += tp.rank
    with torch.no_grad():
        model = LlamaForCausalLM(config, dtype=dtype, device=device, ops=ops or REFERENCE_OPS)
    randomize_(model, seed)
    model.requires_grad_(False)
    return model.eval(), config


def build_random_hf_model(name: str, dtype: torch.dtype, device: Any, seed: int = 0) -> Any:
    """transformers' ``LlamaForCausalLM`` of the same shape, created on ``device`` (the HF peer's model)."""
    from transformers import LlamaForCausalLM

    config = random_config(name)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = LlamaForCausalLM(config)  # transformers types its to() as unbound
    finally:
        torch.set_default_dtype(default_dtype)
    randomize_(model, seed)
    model.requires_grad_(False)
    return model.to(dtype).eval()
