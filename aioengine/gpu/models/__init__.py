"""Model implementations built from a Hugging Face config.json, looked up by ``architectures``."""

from __future__ import annotations

from typing import Any

from aioengine.gpu.models.gemma3 import Gemma3ForCausalLM
from aioengine.gpu.models.llama import LlamaForCausalLM
from aioengine.gpu.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    """The class for the first supported name in ``config.architectures``."""
    architectures = list(getattr(config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architectures {architectures or '(none in config)'}; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )


def sliding_window(cfg: Any) -> int | None:
    """The attention window a config asks for (Mistral: `sliding_window`; Qwen: only with
    `use_sliding_window`), or None. Within it, windowed attention is full attention."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    window = get("sliding_window")
    return int(window) if window and get("use_sliding_window", True) else None


__all__ = [
    "MODEL_REGISTRY",
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "get_model_class",
    "sliding_window",
]
