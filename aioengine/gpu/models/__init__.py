"""Model implementations built from a Hugging Face config.json, looked up by ``architectures``."""

from __future__ import annotations

from typing import Any

from aioengine.gpu.models.gemma3 import Gemma3ForCausalLM
from aioengine.gpu.models.gpt_oss import GptOssForCausalLM
from aioengine.gpu.models.llama import LlamaForCausalLM, sliding_window
from aioengine.gpu.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from aioengine.gpu.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
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


__all__ = [
    "MODEL_REGISTRY",
    "Gemma3ForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "get_model_class",
    "sliding_window",
]
