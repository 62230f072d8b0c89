"""The torch reference of the mixture-of-experts ops: routing a token to its top-k experts, and the fused
expert MLP that runs each expert on its own tokens' rows only.

Expert weights are stacked: ``w13`` is ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and
``w2`` is ``[E, H, I]`` (its down projection), as vLLM's ``FusedMoE`` holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from aioengine.kernels.reference import silu_and_mul


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` router logits -> (weights ``[T, k]`` in the logits' dtype, expert ids ``[T, k]`` int64):
    the top-k of the float32 softmax over all experts, rescaled to sum to 1 with ``renormalize`` (Mixtral,
    Qwen3-MoE's ``norm_topk_prob``), in transformers' order of operations."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def select_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the top-k logits, then a softmax over just those (in the logits' dtype, as
    transformers orders it): (weights ``[T, k]``, expert ids ``[T, k]`` int64)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on ``x [..., 2I]`` (gate columns, then up): the gate clamped from above
    and the up both ways at ``limit``, then ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].clamp(max=limit), x[..., d:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_runs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The token-expert pairs grouped by expert: (indices into ``topk_ids.flatten()`` sorted by expert, in
    token order within one, and each expert's count). An expert no token chose has a count of 0."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist()


class ExpertSet(Protocol):
    """A layer's experts as the op runs them: ``mlp(e, rows)`` is expert ``e``'s SwiGLU on ``rows``
    ``[n, H]`` (stacked weights, or each expert's own quantized linears)."""

    @property
    def num_experts(self) -> int: ...

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor: ...


def fused_moe_by_expert(
    x: torch.Tensor,
    experts: ExpertSet,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``[T, H]`` -> ``[T, H]``: for each token the sum over its k experts of weight * expert(x). Each
    expert runs once, on the rows of the tokens that chose it (an expert no token chose is never read);
    experts add into the output in increasing order (transformers' order, so float32 sums match its
    bits)."""
    k = topk_ids.shape[1]
    out = torch.zeros_like(x)
    order, counts = expert_runs(topk_ids, experts.num_experts)
    weights = topk_weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // k
        out.index_add_(0, tokens, experts.mlp(e, x[tokens]) * weights[pairs, None])
    return out


@dataclass(slots=True)
class StackedExperts:
    """Experts as stacked tensors: ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``."""

    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(rows, self.w13[e])), self.w2[e])


def dequantize_codes(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, block: int
) -> torch.Tensor:
    """``[N, K]`` float32 weights from block codes: ``codes * scales`` per ``block`` inputs (``+ mins`` for
    affine codes), one product then one sum, as the GGUF dequantizer rounds them."""
    n, k = codes.shape
    w = codes.reshape(n, k // block, block).float() * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    return w.reshape(n, k)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe_by_expert`` on stacked weights: for each token the sum over its k experts of weight *
    down(silu(gate x) * up x)."""
    return fused_moe_by_expert(x, StackedExperts(w13, w2), topk_weights, topk_ids)
