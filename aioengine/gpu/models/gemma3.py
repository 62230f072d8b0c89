"""Gemma 3 (text): the Llama code with Gemma's parts, over the same flat batch and paged KV cache.

What differs from Llama: (1 + w) RMSNorms, pre- and post-norms around attention and the MLP, q/k norms,
GeGLU (gelu, tanh approximation), embeddings scaled by sqrt(hidden), attention scaled by
``query_pre_attn_scalar``, sliding-window layers with their own RoPE base interleaved with full ones as
``layer_types`` says, tied embeddings, and an optional final logit soft-cap.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import skip_init

from aioengine.gpu.backend import REFERENCE_OPS, Ops
from aioengine.gpu.layers import GeluTanhAndMul, RotaryEmbedding
from aioengine.gpu.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    _linear,
    head_dim_of,
    layer_windows,
)
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.sched.kv_cache_spec import kv_cache_groups, layer_slots


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)``, computed in float32 (HF's Gemma3RMSNorm); the checkpoint holds w."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.gemma_rms_norm(x, self.weight, self.variance_epsilon, residual)


def _rope_for(config: Any, layer_type: str) -> tuple[float, dict[str, Any]]:
    """(base, scaling) of one layer type: transformers 5's per-type ``rope_parameters``, else 4.x's
    ``rope_local_base_freq`` (sliding) and ``rope_theta`` / ``rope_scaling`` (full)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        p = dict(params[layer_type])
        return float(p.pop("rope_theta")), p
    if layer_type == "sliding_attention":
        return float(getattr(config, "rope_local_base_freq", 10000.0)), {}
    return float(getattr(config, "rope_theta", 1e6)), dict(getattr(config, "rope_scaling", None) or {})


def gemma_rope(
    config: Any, layer_type: str, max_position: int, dtype: torch.dtype, device: Any, ops: Ops
) -> RotaryEmbedding:
    head_dim = head_dim_of(config)
    base, scaling = _rope_for(config, layer_type)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = None
    if rope_type == "linear":  # Gemma 3 4B and up scale their global layers' positions
        default = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq, scaling = default / float(scaling["factor"]), {}
    return RotaryEmbedding(
        head_dim, max_position, base, scaling or None, dtype=dtype, device=device, inv_freq=inv_freq, ops=ops
    )


def layer_types_of(config: Any) -> list[str]:
    """``layer_types``, or Gemma 3's older ``sliding_window_pattern`` (every n-th layer full)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    every: Any = getattr(config, "sliding_window_pattern", None)  # a config value: not typed
    pattern = int(every or getattr(config, "_sliding_window_pattern", 6))
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    ]


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: Any, dtype: torch.dtype, device: Any, ops: Ops, **kwargs: Any) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("attention logit soft-capping (Gemma 2) is not supported")
        super().__init__(config, dtype, device, qk_norm=False, ops=ops, **kwargs)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype, device, ops)
        self.scaling = float(config.query_pre_attn_scalar) ** -0.5


class Gemma3MLP(LlamaMLP):
    def __init__(self, config: Any, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"Gemma 3 MLP activation {act!r} is not supported (gelu_pytorch_tanh)")
        super().__init__(config, dtype, device, ops, act_fn=GeluTanhAndMul(ops))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: Any,
        ops: Ops,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
        kv_group: int,
    ) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(
            config,
            dtype,
            device,
            ops,
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            rotary_emb=rotary_emb,
            sliding_window=sliding_window,
            kv_group=kv_group,
        )
        self.mlp = Gemma3MLP(config, dtype, device, ops)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype, device, ops)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype, device, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype, device, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual threads through as in Llama: each pre-norm also performs the pending add.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(
            self.self_attn(positions, hidden_states, kv_cache, meta)
        )
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma3Model(LlamaModel):
    """Gemma's layers and norms; the forward is Llama's, with the embeddings scaled."""

    def __init__(self, config: Any, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.embed_tokens = skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        # HF keeps the scale as a float32 tensor and casts it to the weights' dtype.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype))
        self.layer_types = layer_types_of(config)
        windows = layer_windows(config, self.layer_types)
        self.ropes = self.make_ropes(config.max_position_embeddings, dtype, device, ops)
        self.kv_cache_groups = kv_cache_groups(windows)
        slots = layer_slots(self.kv_cache_groups, len(windows))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, dtype, device, ops, self.ropes[t], w, g)
            for t, w, (g, _) in zip(self.layer_types, windows, slots, strict=True)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, ops)

    def make_ropes(
        self, max_position: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> dict[str, RotaryEmbedding]:
        return {
            t: gemma_rope(self.config, t, max_position, dtype, device, ops) for t in set(self.layer_types)
        }

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model; the head is the (tied) embedding, its logits soft-capped where set."""

    model: Gemma3Model

    def __init__(
        self, config: Any, dtype: torch.dtype = torch.float32, device: Any = "cpu", ops: Ops = REFERENCE_OPS
    ) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.ops = ops
        self.model = Gemma3Model(config, dtype, device, ops)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def cover_positions(self, max_model_len: int) -> None:
        model = self.model
        table = next(iter(model.ropes.values())).cos_sin_cache
        if table.shape[0] >= max_model_len:
            return
        model.ropes = model.make_ropes(max_model_len, table.dtype, table.device, self.ops)
        for layer, t in zip(model.layers, model.layer_types, strict=True):
            cast(LlamaAttention, layer.self_attn).rotary_emb = model.ropes[t]
