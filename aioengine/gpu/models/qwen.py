"""Qwen2 and Qwen3: the Llama code with Qwen's attention switches."""

from __future__ import annotations

from typing import Any

from aioengine.gpu.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        return True, False  # q/k/v always carry a bias, o_proj never


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True  # per-head RMSNorm on q and k before RoPE; biases follow attention_bias
