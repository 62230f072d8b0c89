"""Model building blocks shared by the model files: RMSNorm, rotary embedding, SiluAndMul, GeluTanhAndMul.

Each module calls the op set (``aioengine.gpu.backend.Ops``) it was built with: the backend's kernels,
or the torch references when none is given. None of them looks at the device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from aioengine.gpu.backend import REFERENCE_OPS, Ops


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
        device: Any = None,
        ops: Ops = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` like vLLM's fused op."""
        return self.ops.rms_norm(x, self.weight, self.variance_epsilon, residual)


class SiluAndMul(nn.Module):
    activation = "silu"  # the gate's activation: a backend may fuse it into the gate_up projection

    def __init__(self, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU (Gemma's MLP): gelu with the tanh approximation on the gate."""

    activation = "gelu_tanh"

    def __init__(self, ops: Ops = REFERENCE_OPS) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)


def rope_parameters(config: Any) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, scaling dict)`` from a transformers 5 (``rope_parameters``) or 4.x config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or 10000.0
    return float(theta), params


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (transformers' ``_compute_llama3_parameters``)."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary embedding with a ``[max_position, head_dim]`` cos|sin cache built once."""

    cos_sin_cache: torch.Tensor  # a buffer, registered in __init__

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        device: Any = None,
        inv_freq: torch.Tensor | None = None,
        attention_scaling: float = 1.0,
        ops: Ops = REFERENCE_OPS,
    ) -> None:
        """``inv_freq``/``attention_scaling``: given by transformers for the scaled types it computes
        (see ``get_rope``); otherwise the default frequencies, or llama3's."""
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        assert head_dim % 2 == 0
        self.head_dim = head_dim
        if inv_freq is None:
            # HF computes frequencies in fp32 and casts cos/sin to the activation dtype.
            inv_freq = 1.0 / (
                base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
            )
            if rope_type == "llama3":
                assert rope_scaling is not None  # its rope_type said llama3
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type != "default":
                raise NotImplementedError(
                    f"rope_scaling type {rope_type!r} is not supported "
                    f"(supported: default, {', '.join(('llama3', *_STATIC_HF_ROPE))})"
                )
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling  # as HF: scale, then cast
        cos, sin = cos.to(dtype), sin.to(dtype)
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)
        self.ops = ops

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query ``[T, Hq, D]`` and key ``[T, Hkv, D]`` by ``positions`` ``[T]``."""
        return self.ops.rotary(positions, query, key, self.cos_sin_cache)


# Scalings whose frequencies do not depend on the sequence length: transformers' own functions compute
# them (dynamic NTK and longrope change with the length of each forward, which a cached table cannot).
_STATIC_HF_ROPE = ("linear", "yarn")


def get_rope(
    head_dim: int,
    max_position: int,
    config: Any,
    dtype: torch.dtype,
    device: Any = None,
    ops: Ops = REFERENCE_OPS,
) -> RotaryEmbedding:
    """The rotary embedding a HF config asks for (a model builds one and shares it across its layers)."""
    base, scaling = rope_parameters(config)
    if float(getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in _STATIC_HF_ROPE:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return RotaryEmbedding(
            head_dim,
            max_position,
            base,
            scaling,
            dtype=dtype,
            device=device,
            inv_freq=inv_freq,
            attention_scaling=float(attention_scaling),
            ops=ops,
        )
    return RotaryEmbedding(head_dim, max_position, base, scaling or None, dtype=dtype, device=device, ops=ops)
