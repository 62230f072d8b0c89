"""gpt-oss (``GptOssForCausalLM``): the Llama code with attention sinks and biases, sliding-window layers
beside full ones, YaRN RoPE, and a routed block of experts with biases and a clamped SwiGLU whose
checkpoint tensors are stacked (bf16) or MXFP4 block codes, converted here as they are read."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from aioengine.gpu.backend import Ops
from aioengine.gpu.models.moe import Experts, FusedMoE, _MoEForCausalLM, _Stacked
from aioengine.kernels.reference_moe import clamped_swiglu, select_topk_softmax
from aioengine.model.mxfp4 import dequantize_mxfp4


class GptOssExperts(Experts):
    """Stacked ``w13 [E, 2I, H]`` (gate rows, then up rows: the checkpoint's interleaved columns split)
    and ``w2 [E, H, I]``, with their biases ``b13 [E, 2I]`` and ``b2 [E, H]``; the clamped SwiGLU."""

    def __init__(
        self, experts: int, hidden: int, inter: int, alpha: float, limit: float, dtype: Any, device: Any
    ) -> None:
        w13 = _Stacked(
            (experts, 2 * inter, hidden), {str(e): (e, 0, 2 * inter) for e in range(experts)}, dtype, device
        )
        w2 = _Stacked(
            (experts, hidden, inter), {str(e): (e, 0, hidden) for e in range(experts)}, dtype, device
        )
        super().__init__(w13, w2)
        self.b13 = nn.Parameter(torch.empty(experts, 2 * inter, dtype=dtype, device=device))
        self.b2 = nn.Parameter(torch.empty(experts, hidden, dtype=dtype, device=device))
        self.alpha, self.limit = alpha, limit

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        # transformers' order: each product, then its bias (quantized linears carry none)
        if self.linears is not None:
            gate_up = self.linears[2 * e](rows) + self.b13[e]
            down = self.linears[2 * e + 1](clamped_swiglu(gate_up, self.alpha, self.limit))
            return cast(torch.Tensor, down) + self.b2[e]
        assert self.w13 is not None and self.w2 is not None  # stacked until quantized
        gate_up = rows @ self.w13.weight[e].t() + self.b13[e]
        return clamped_swiglu(gate_up, self.alpha, self.limit) @ self.w2.weight[e].t() + self.b2[e]


class GptOssMoE(FusedMoE):
    """A router with a bias, top-k of its logits softmaxed (no renormalisation), and GptOssExperts."""

    def __init__(self, config: Any, dtype: torch.dtype, device: Any, ops: Ops) -> None:
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        n, top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        alpha = float(getattr(config, "swiglu_alpha", None) or 1.702)
        limit = float(getattr(config, "swiglu_limit", None) or 7.0)
        experts = GptOssExperts(n, hidden, inter, alpha, limit, dtype, device)
        super().__init__(
            hidden, inter, n, top_k, False, dtype, device, ops, experts=experts, router_bias=True
        )
        self.expert_parameters += n * (2 * inter + hidden)  # the experts' biases

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_topk_softmax(self.gate(x), self.top_k)
        return self.ops.all_reduce(self.ops.fused_moe(x, self.experts, weights, ids))


def _split_interleaved(w: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries along ``dim`` alternating gate, up (the checkpoint's order) -> the gates, then the ups."""
    n = w.shape[dim]
    return w.index_select(dim, torch.cat((torch.arange(0, n, 2), torch.arange(1, n, 2))).to(w.device))


class GptOssForCausalLM(_MoEForCausalLM):
    """gpt-oss-20b/120b: every layer routes; attention with biases and sinks; windows from ``layer_types``."""

    attention_sinks = True

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    def make_mlp(
        self, config: Any, layer: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> nn.Module | None:
        return GptOssMoE(config, dtype, device, ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._converted(weights))

    def _converted(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors in this model's names and layouts: the router as ``gate``, and each
        expert's weights (bf16 ``[E, in, out]``, or MXFP4 blocks and scales ``[E, out, in / 32, ...]``,
        converted one expert at a time) as ``<layer>.mlp.experts.w13.weight@<expert>``."""
        pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # MXFP4 halves awaiting the other
        for name, t in weights:
            layer, sep, rest = name.partition(".mlp.experts.")
            if not sep:
                yield name.replace(".mlp.router.", ".mlp.gate."), t
                continue
            experts = f"{layer}.mlp.experts"
            if rest == "gate_up_proj_bias":
                yield f"{experts}.b13", _split_interleaved(t, 1)
            elif rest == "down_proj_bias":
                yield f"{experts}.b2", t
            elif rest in ("gate_up_proj", "down_proj"):  # [E, in, out]
                for e in range(t.shape[0]):
                    yield self._expert(experts, rest, e, t[e].t())
            elif rest.endswith(("_blocks", "_scales")):
                proj, _, kind = rest.rpartition("_")
                pair = pending.setdefault((experts, proj), {})
                pair[kind] = t
                if len(pair) == 2:
                    del pending[(experts, proj)]
                    for e in range(pair["blocks"].shape[0]):  # [E, out, in / 32, 16]: one expert at a time
                        yield self._expert(
                            experts, proj, e, dequantize_mxfp4(pair["blocks"][e], pair["scales"][e])
                        )
            else:
                raise ValueError(f"unexpected expert weight {name!r} for {type(self).__name__}")
        if pending:
            halves = ", ".join(f"{experts}.{proj}_{next(iter(p))}" for (experts, proj), p in pending.items())
            raise ValueError(f"MXFP4 tensors without their other half (blocks or scales): {halves}")

    @staticmethod
    def _expert(experts: str, proj: str, e: int, w: torch.Tensor) -> tuple[str, torch.Tensor]:
        """Expert ``e``'s ``[out, in]`` weight of ``proj`` as the stacked parameter's shard."""
        if proj == "gate_up_proj":
            return f"{experts}.w13.weight@{e}", _split_interleaved(w, 0)
        if proj == "down_proj":
            return f"{experts}.w2.weight@{e}", w
        raise ValueError(f"unexpected expert weight {experts}.{proj} for gpt-oss")

    def _param_name(self, hf_name: str) -> tuple[str, str | None]:
        name, at, expert = hf_name.partition("@")
        return (name, expert) if at else super()._param_name(hf_name)
