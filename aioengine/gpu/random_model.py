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
_QWEN3_MOE: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"],
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
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
    # A mixture of OLMoE-1B-7B's shape as Qwen3-MoE (q/k norms, as OLMoE): 64 experts of 1024 columns,
    # top-8, 16 layers of 2048.
    "moe-7b-a1b": dict(
        **_QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=1024,
        moe_intermediate_size=1024,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=50304,
        max_position_embeddings=4096,
    ),
    "moe-tiny": dict(
        **_QWEN3_MOE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        max_position_embeddings=1024,
    ),
}
_CONFIGS = {"LlamaForCausalLM": "LlamaConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig"}


def is_random_model(name: str | None) -> bool:
    return bool(name and name.startswith(RANDOM_PREFIX))


def random_config(name: str) -> Any:
    """The transformers config of ``random:NAME`` (or of a bare NAME): a Llama's unless it names another."""
    import transformers

    key = name.removeprefix(RANDOM_PREFIX)
    if key not in SHAPES:
        from aioengine.model.random_gguf import GGUF_SHAPES

        known = ", ".join(RANDOM_PREFIX + k for k in [*SHAPES, *GGUF_SHAPES])
        raise ValueError(f"unknown random model {name!r}; known: {known}")
    shape = {"architectures": ["LlamaForCausalLM"], **SHAPES[key]}
    return getattr(transformers, _CONFIGS[shape["architectures"][0]])(**shape)


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
    """(our model with random weights on ``device``, built with ``ops``, its HF config)."""
    from aioengine.gpu.backend import REFERENCE_OPS
    from aioengine.gpu.models import get_model_class

    config = random_config(name)
    model_cls = get_model_class(config)
    tp = getattr(ops, "tp", None)
    if tp is not None:  # each rank draws its own part (throughput does not depend on the values)
        from aioengine.gpu.parallel import shard_config, shard_of

        config = shard_config(config, shard_of(config, tp.rank, tp.size))
        seed += tp.rank
    with torch.no_grad():
        model = model_cls(config, dtype=dtype, device=device, ops=ops or REFERENCE_OPS)
    randomize_(model, seed)
    model.requires_grad_(False)
    return model.eval(), config


def build_random_hf_model(name: str, dtype: torch.dtype, device: Any, seed: int = 0) -> Any:
    """transformers' model of the same shape, created on ``device`` (the HF peer's model)."""
    import transformers

    config = random_config(name)
    model_cls = getattr(transformers, config.architectures[0])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = model_cls(config)  # transformers types its to() as unbound
    finally:
        torch.set_default_dtype(default_dtype)
    randomize_(model, seed)
    model.requires_grad_(False)
    return model.to(dtype).eval()
