"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral): the Llama code with a routed block of
experts in place of a layer's MLP, the experts stacked as the backend's fused-MoE op takes them."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from aioengine.gpu.backend import Ops
from aioengine.gpu.models.llama import LlamaForCausalLM, LlamaMLP
from aioengine.kernels.reference import silu_and_mul
from aioengine.kernels.reference_moe import StackedExperts, dequantize_codes, select_experts
from aioengine.model import gguf_codes


class Router(nn.Linear):
    """The router's logits. Its own type, so that no backend packs or quantizes it (the linears' rewrites
    take plain nn.Linear only): which experts run must not move with the experts' rounding, and it is tiny."""


class _Stacked(nn.Module):
    """One stacked expert weight ``[E, rows, cols]``; ``shard_offsets``: where each checkpoint tensor goes."""

    def __init__(
        self, shape: tuple[int, int, int], offsets: dict[str, tuple[int, int, int]], dtype: Any, device: Any
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.shard_offsets = offsets  # "<expert>.<proj>" -> (expert, first row, rows)


class Experts(nn.Module):
    """A layer's experts: stacked (``w13``, ``w2``), or once quantized each expert's own gate_up and down
    linears (``linears``: gate_up of expert e at 2e, its down at 2e + 1; the stacked copies are dropped)."""

    def __init__(self, w13: _Stacked, w2: _Stacked) -> None:
        super().__init__()
        self.num_experts = w13.weight.shape[0]
        self.w13: _Stacked | None = w13
        self.w2: _Stacked | None = w2
        self.linears: nn.ModuleList | None = None

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU on ``rows``."""
        if self.linears is not None:
            return cast(torch.Tensor, self.linears[2 * e + 1](silu_and_mul(self.linears[2 * e](rows))))
        assert self.w13 is not None and self.w2 is not None  # stacked until quantized
        return StackedExperts(self.w13.weight, self.w2.weight).mlp(e, rows)

    def quantize(self, make: Callable[[torch.Tensor], nn.Module]) -> int:
        """Each expert's gate_up and down become ``make(weight)``; returns how many linears."""
        assert self.w13 is not None and self.w2 is not None, "quantized once"
        w13, w2 = self.w13.weight.data, self.w2.weight.data
        self.linears = nn.ModuleList(make(w[e]) for e in range(self.num_experts) for w in (w13, w2))
        self.w13 = self.w2 = None
        return len(self.linears)


# A backend's linear on block codes: (codes [N, K], scales, mins or None, block) -> module
MakeCoded = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], nn.Module]


class CodedExperts(Experts):
    """A layer's experts on a GGUF's block codes (model/gguf_codes.py), never held as float weights: the
    checkpoint's stacked codes, scales and mins per projection (4-bit codes two to a byte), each expert
    dequantized for its own rows only on the torch path, until a backend turns them into its kernels' linears
    (``to_linears``)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, device: Any) -> None:
        nn.Module.__init__(self)  # no stacked weights
        self.num_experts = num_experts
        self.w13 = self.w2 = None
        self.linears = None
        self.device = device
        # [rows, inputs] of each projection
        self.shapes = {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        self.parts: dict[str, dict[str, torch.Tensor]] = {"gate_up": {}, "down": {}}
        self.fused: object | None = None  # a backend's whole-layer form of the linears, for its fused_moe op
        self.nbytes = 0  # the codes, scales and mins as loaded (what all the experts take)

    def load(self, proj: str, part: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor ``<proj>.<codes|scales|mins>``, checked against the layer's shape."""
        rows, cols = self.shapes[proj]
        units = (1, 2) if part == "codes" else (16, 32)  # inputs per column: codes (4-bit: 2), or per block
        if (
            tensor.dim() != 3
            or tensor.shape[:2] != (self.num_experts, rows)
            or all(tensor.shape[2] * u != cols for u in units)
        ):
            raise ValueError(
                f"experts' {proj}.{part} has shape {list(tensor.shape)}, but the config needs "
                f"[{self.num_experts}, {rows}, {cols} inputs in units of {' or '.join(map(str, units))}]"
            )
        self.parts[proj][part] = tensor.to(self.device)
        self.nbytes += tensor.nbytes

    def missing(self) -> list[str]:
        """The tensors not loaded yet (affine 4-bit codes, uint8, need their mins)."""
        out = []
        for proj, parts in self.parts.items():
            codes = parts.get("codes")
            affine = codes is not None and codes.dtype == torch.uint8
            need = {"codes", "scales"} | ({"mins"} if affine else set())
            out += [f"{proj}.{part}" for part in sorted(need - parts.keys())]
        return out

    def check(self) -> None:
        """Every part loaded and of one kind: int8 codes with float32 scales per 16 or 32 inputs, or affine
        4-bit codes two to a byte (uint8) with float32 scales and mins per 32."""
        if self.missing():
            raise ValueError(f"checkpoint is missing weights: experts' {', '.join(self.missing())}")
        for proj, parts in self.parts.items():
            codes, scales, mins = parts["codes"], parts["scales"], parts.get("mins")
            cols = self.shapes[proj][1]
            if codes.dtype == torch.uint8:
                ok = codes.shape[2] * 2 == cols and mins is not None and scales.shape[2] * 32 == cols
                ok = ok and mins is not None and mins.shape == scales.shape and mins.dtype == torch.float32
            else:
                ok = codes.dtype == torch.int8 and codes.shape[2] == cols and mins is None
                ok = ok and scales.shape[2] in (cols // 16, cols // 32) and cols % scales.shape[2] == 0
            if not ok or scales.dtype != torch.float32:
                raise ValueError(
                    f"experts' {proj} codes ({codes.dtype}, {list(codes.shape)}), scales "
                    f"({scales.dtype}, {list(scales.shape)}) and mins are not one kind of block codes for "
                    f"{cols} inputs: int8 codes with float32 scales per 16 or 32, or 4-bit codes two to a "
                    "byte (uint8) with float32 scales and mins per 32"
                )

    def codes(self, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """Expert ``e``'s (codes ``[N, K]``, scales, mins or None, block) of ``proj``."""
        parts = self.parts[proj]
        codes, scales, mins = parts["codes"][e], parts["scales"][e], parts.get("mins")
        if mins is not None:
            codes = torch.stack((codes & 15, codes >> 4), -1).reshape(codes.shape[0], -1)
            mins = mins[e]
        return codes, scales, mins, codes.shape[1] // scales.shape[1]

    def mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self.linears is not None:
            return super().mlp(e, rows)
        w13 = dequantize_codes(*self.codes(e, "gate_up")).to(rows.dtype)
        w2 = dequantize_codes(*self.codes(e, "down")).to(rows.dtype)
        return F.linear(silu_and_mul(F.linear(rows, w13)), w2)

    def to_linears(self, make: MakeCoded) -> int:
        """Each expert's gate_up and down become ``make(codes, scales, mins, block)`` (a backend's linear on
        codes); the stacked tensors go. Returns how many linears."""
        self.check()
        self.linears = nn.ModuleList(
            make(*self.codes(e, proj)) for e in range(self.num_experts) for proj in ("gate_up", "down")
        )
        self.parts = {"gate_up": {}, "down": {}}
        return len(self.linears)

    def quantize(self, make: Callable[[torch.Tensor], nn.Module]) -> int:
        raise ValueError("experts on a GGUF's block codes are quantized already")


class FusedMoE(nn.Module):
    """A router (``gate``) and E experts: ``experts.w13`` ``[E, 2 * I, H]`` (gate rows, then up rows) and
    ``experts.w2`` ``[E, H, I]``. A token runs its top-k experts, weighted by the router."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        dtype: torch.dtype,
        device: Any,
        ops: Ops,
        experts: Experts | None = None,
        router_bias: bool = False,
        coded: bool = False,
    ) -> None:
        """``experts``: a model's own kind (gpt-oss's, with biases); by default SwiGLU experts stacked from
        the checkpoint's per-expert tensors, or with ``coded`` held as its block codes (``CodedExperts``)."""
        super().__init__()
        assert 0 < top_k <= num_experts, f"top-{top_k} of {num_experts} experts"
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_parameters = num_experts * 3 * hidden * intermediate
        self.gate = skip_init(Router, hidden, num_experts, bias=router_bias, dtype=dtype, device=device)
        if experts is None and coded:
            experts = CodedExperts(num_experts, hidden, intermediate, device)
        if experts is None:
            e_range = range(num_experts)
            gate_up = {f"{e}.gate_proj": (e, 0, intermediate) for e in e_range}
            gate_up |= {f"{e}.up_proj": (e, intermediate, intermediate) for e in e_range}
            down = {f"{e}.down_proj": (e, 0, hidden) for e in e_range}
            experts = Experts(
                _Stacked((num_experts, 2 * intermediate, hidden), gate_up, dtype, device),
                _Stacked((num_experts, hidden, intermediate), down, dtype, device),
            )
        self.experts = experts
        self.ops = ops
        # Qwen2-MoE's shared expert, added to every token's output behind a sigmoid gate
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.ops.all_reduce(self.ops.fused_moe(x, self.experts, weights, ids))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # set together
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def num_experts_of(config: Any) -> int:
    """The config's expert count (Mixtral's ``num_local_experts``, Qwen-MoE's ``num_experts``); 0 for none."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def num_active_parameters(model: nn.Module) -> int:
    """The parameters a token runs through: all of them, less the experts it does not choose (the
    roofline's and the bytes-per-token figure's count for a mixture)."""
    total = sum(p.numel() for p in model.parameters())
    for m in model.modules():
        if isinstance(m, FusedMoE):  # its experts however held (floats with biases, codes): a k / E share
            held = sum(p.numel() for p in m.experts.parameters())
            total += (held or m.expert_parameters) * m.top_k // m.num_experts - held
    return total


def num_parameters(model: nn.Module) -> int:
    """The model's parameters, a mixture's experts on codes counted by their shape (not parameters)."""
    total = sum(p.numel() for p in model.parameters())
    return total + sum(m.expert_parameters for m in _coded_blocks(model))


def active_weight_bytes(model: nn.Module, bytes_per_parameter: int) -> int:
    """The weight bytes a token reads: its active parameters at ``bytes_per_parameter``, but experts on codes
    at their codes' bytes (the chosen top-k's share of them)."""
    active = num_active_parameters(model)
    coded = 0
    for m in _coded_blocks(model):
        active -= m.expert_parameters * m.top_k // m.num_experts
        coded += cast(CodedExperts, m.experts).nbytes * m.top_k // m.num_experts
    return active * bytes_per_parameter + coded


def _coded_blocks(model: nn.Module) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE) and isinstance(m.experts, CodedExperts)]


# A checkpoint's per-expert tensor: "<layer>.<block>.experts.<e>.<proj>.weight"
_EXPERT = re.compile(
    r"^(?P<layer>.*\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$"
)


class _MoEForCausalLM(LlamaForCausalLM):
    """The Llama family with routed experts; subclasses say which layers are sparse and how they route."""

    has_experts = True
    expert_names = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}

    @staticmethod
    def num_experts(config: Any) -> int:
        n = num_experts_of(config)
        if not n:
            raise ValueError(f"{type(config).__name__} names no experts (num_experts / num_local_experts)")
        return n

    def expert_intermediate(self, config: Any) -> int:
        return int(config.intermediate_size)

    def is_sparse(self, config: Any, layer: int) -> bool:
        return True

    def routes_with(self, config: Any) -> bool:
        """Whether the top-k weights are renormalised (Mixtral's always are)."""
        return True

    def make_mlp(
        self, config: Any, layer: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> nn.Module | None:
        if not self.is_sparse(config, layer):
            return None
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported experts' hidden_act {config.hidden_act!r}: the experts run SwiGLU")
        return FusedMoE(
            config.hidden_size,
            self.expert_intermediate(config),
            self.num_experts(config),
            int(config.num_experts_per_tok),
            self.routes_with(config),
            dtype,
            device,
            ops,
            coded=bool(getattr(config, "expert_block_codes", False)),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The Llama loader's, with a GGUF's expert codes (``<layer>.mlp.experts.<proj>.<part>``) going to
        the layers' ``CodedExperts``."""
        modules = dict(self.named_modules())

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = gguf_codes.EXPERT_CODES.match(name)
                if m is None:
                    yield name, tensor
                    continue
                experts = modules.get(f"{m['layer']}.mlp.experts")
                if not isinstance(experts, CodedExperts):
                    raise ValueError(f"unexpected weight {name!r}: this layer's experts are not block codes")
                experts.load(m["proj"], m["part"], tensor)

        super().load_weights(others())
        for name, m in modules.items():
            if isinstance(m, CodedExperts):
                try:
                    m.check()
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None

    def _param_name(self, hf_name: str) -> tuple[str, str | None]:
        m = _EXPERT.match(hf_name)
        if m is not None:
            proj = self.expert_names.get(m["proj"])
            if proj is None:
                raise ValueError(f"unexpected expert weight {hf_name!r} for {type(self).__name__}")
            param = "w2" if proj == "down_proj" else "w13"
            return f"{m['layer']}.mlp.experts.{param}.weight", f"{m['e']}.{proj}"
        return super()._param_name(hf_name.replace(".block_sparse_moe.", ".mlp."))


class Qwen3MoeForCausalLM(_MoEForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms); layers past ``mlp_only_layers``, every
    ``decoder_sparse_step``-th, route to top-k of the softmax, renormalised when ``norm_topk_prob``."""

    qk_norm = True

    def expert_intermediate(self, config: Any) -> int:
        return int(config.moe_intermediate_size)

    def is_sparse(self, config: Any, layer: int) -> bool:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        return (
            self.num_experts(config) > 0
            and layer not in (getattr(config, "mlp_only_layers", None) or [])
            and (layer + 1) % step == 0
        )

    def routes_with(self, config: Any) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, no q/k norms), Qwen3-MoE's
    routing, and a shared expert of ``shared_expert_intermediate_size`` every token runs, scaled by
    ``sigmoid(shared_expert_gate(x))``."""

    qk_norm = False

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def make_mlp(
        self, config: Any, layer: int, dtype: torch.dtype, device: Any, ops: Ops
    ) -> nn.Module | None:
        block = super().make_mlp(config, layer, dtype, device, ops)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        if isinstance(block, FusedMoE) and shared:
            shared_config = copy.copy(config)
            shared_config.intermediate_size = shared
            block.shared_expert = LlamaMLP(shared_config, dtype, device, ops)
            block.shared_expert_gate = skip_init(
                Router, config.hidden_size, 1, bias=False, dtype=dtype, device=device
            )
        return block


class MixtralForCausalLM(_MoEForCausalLM):
    """Mixtral: Mistral's attention; every layer routes to the top-k experts, renormalised (a softmax over
    the top-k logits). Its experts are named w1 (gate), w3 (up) and w2 (down)."""

    expert_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


__all__ = [
    "CodedExperts",
    "Experts",
    "FusedMoE",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "active_weight_bytes",
    "num_active_parameters",
    "num_experts_of",
    "num_parameters",
]
