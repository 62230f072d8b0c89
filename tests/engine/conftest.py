"""Tiny random-weight checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma 3 with sliding windows, and the
mixtures of experts Qwen3-MoE, Mixtral and gpt-oss) with a real tokenizer, for engine tests."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from aioengine.model.files import resolve_model

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=512,
    eos_token_id=2,
)
TINY = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
    # every layer windowed; prompts run past the window
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=32)),
    # mixtures of experts: 8 experts, top-2, renormalised, the first layer dense; 4 experts, top-2 (Mixtral)
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    # attention sinks and biases, a windowed layer beside a full one, YaRN, 4 experts (top-2) with biases and
    # a clamped SwiGLU whose limit the random weights reach
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=2.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # a windowed layer (its own RoPE base) beside a full one, GeGLU, (1 + w) norms, soft-capped logits
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            head_dim=16,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
        ),
    ),
}


def make_tiny_checkpoint(kind: str, path, **overrides) -> transformers.PreTrainedModel:
    """A tiny random checkpoint of ``kind``; ``overrides`` replace config fields (e.g. rope_scaling)."""
    config_cls, model_cls, extra = TINY[kind]
    torch.manual_seed(0)
    return save_tiny(model_cls(config_cls(**{**SMALL, **extra, **overrides})), path)


def save_tiny(
    model: transformers.PreTrainedModel, path, tokenizer: bool = True
) -> transformers.PreTrainedModel:
    """``model`` in float32 with random weights (from torch's generator as it stands), saved at ``path``
    with the default model's tokenizer unless ``tokenizer`` is false."""
    model = model.float().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise so they are tested too
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
            if name.endswith(".sinks"):  # gpt-oss: sinks on the scores' scale, so they move the output
                p.mul_(10.0).add_(4.0)
    model.save_pretrained(path)
    if not tokenizer:
        return model
    default = resolve_model("default")
    for f in default.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return model


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny_checkpoint(request, tmp_path_factory):
    """(kind, path, HF model) for each tiny architecture."""
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return request.param, path, make_tiny_checkpoint(request.param, path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_tiny_checkpoint("llama", path)


@pytest.fixture(scope="session")
def tiny_checkpoint_of(tmp_path_factory):
    """make(kind, **config overrides) -> the path of that tiny checkpoint, made once per session."""
    made: dict = {}

    def make(kind: str, **overrides):
        key = (kind, repr(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            make_tiny_checkpoint(kind, path, **overrides)
            made[key] = path
        return made[key]

    return make
