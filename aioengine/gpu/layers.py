"""Model building blocks shared by the model files: RMSNorm, rotary embedding, SiluAndMul.

Each op's math sits in a small torch function (the CPU path); on CUDA tensors the modules call the
Triton kernels of ``aioengine.kernels`` instead (imported on first use: the CPU path never needs triton).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aioengine.kernels import cpu_kernels

# CPU bf16: the fused C kernels of cpu_elementwise.c (False: the torch ops, the reference; tests flip it).
use_cpu_kernels = True


@functools.cache
def triton_ops() -> SimpleNamespace:
    """The Triton kernels for CUDA tensors, imported once."""
    from aioengine.kernels.activation import silu_and_mul_triton
    from aioengine.kernels.norm_rope import rms_norm_triton, rotary_triton

    return SimpleNamespace(rms_norm=rms_norm_triton, rotary=rotary_triton, silu_and_mul=silu_and_mul_triton)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order: normalise in fp32, cast back, then scale (so bf16 outputs match HF bit for bit)."""
    # torch's fused rms_norm on the fp32 copy: the same bits as x * rsqrt(mean(x^2) + eps), fewer ops.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device: Any = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` like vLLM's fused op."""
        if x.is_cuda:
            return triton_ops().rms_norm(x, self.weight, self.variance_epsilon, residual)
        if use_cpu_kernels and x.dim() == 2 and cpu_kernels.elementwise_ok(x):  # bf16: one fused pass
            if residual is None:
                return cpu_kernels.add_rms_norm(None, x, self.weight, self.variance_epsilon)[0]
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        residual = x + residual
        return rms_norm(residual, self.weight, self.variance_epsilon), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate_up projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return triton_ops().silu_and_mul(x)
        return silu_and_mul(x)


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
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif rope_type != "default":
                raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported "
                                          f"(supported: default, {', '.join(('llama3', *_STATIC_HF_ROPE))})")
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(device=device, dtype=torch.float32))
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling  # as HF: scale, then cast
        cos, sin = cos.to(dtype), sin.to(dtype)
        self.register_buffer("cos_sin_cache", torch.cat((cos, sin), dim=-1), persistent=False)
        # CPU path: full-width tables, so a rotation is x * cos2 + roll(x) * sin2 (4 ops for q and k
        # together instead of 8 each; the same roundings as HF's rotate_half, so the same bits).
        on_cpu = torch.device(device or "cpu").type == "cpu"
        self.register_buffer("cos2", torch.cat((cos, cos), dim=-1) if on_cpu else None, persistent=False)
        self.register_buffer("sin2", torch.cat((-sin, sin), dim=-1) if on_cpu else None, persistent=False)
        self._memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query ``[T, Hq, D]`` and key ``[T, Hkv, D]`` by ``positions`` ``[T]``."""
        if query.is_cuda:
            return triton_ops().rotary(positions, query, key, self.cos_sin_cache)
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """CPU: rotate ``x`` ``[T, H, D]`` (q and k heads side by side work too) by ``positions``."""
        if (use_cpu_kernels and self.cos2.dtype == x.dtype and x.stride(2) == 1 and x.stride(1) == x.shape[2]
                and positions.dtype == torch.int64 and positions.is_contiguous() and cpu_kernels.elementwise_ok(x)):
            return cpu_kernels.rotary(x, positions, self.cos2, self.sin2)  # bf16: one pass, the same roundings
        memo = self._memo
        if memo is not None and memo[0] is positions:  # every layer of a step shares one lookup
            cos2, sin2 = memo[1], memo[2]
        else:
            cos2 = self.cos2.index_select(0, positions).unsqueeze(1)
            sin2 = self.sin2.index_select(0, positions).unsqueeze(1)
            self._memo = (positions, cos2, sin2)
        return x * cos2 + x.roll(self.head_dim // 2, -1) * sin2


# Scalings whose frequencies do not depend on the sequence length: transformers' own functions compute
# them (dynamic NTK and longrope change with the length of each forward, which a cached table cannot).
_STATIC_HF_ROPE = ("linear", "yarn")


def get_rope(
    head_dim: int, max_position: int, config: Any, dtype: torch.dtype, device: Any = None
) -> RotaryEmbedding:
    """The rotary embedding a HF config asks for (a model builds one and shares it across its layers)."""
    base, scaling = rope_parameters(config)
    if float(getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in _STATIC_HF_ROPE:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return RotaryEmbedding(head_dim, max_position, base, scaling, dtype=dtype, device=device,
                               inv_freq=inv_freq, attention_scaling=float(attention_scaling))
    return RotaryEmbedding(head_dim, max_position, base, scaling or None, dtype=dtype, device=device)
