"""Linear layers with bf16 weights packed once at load time for the CPU's GEMM kernels.

Where the C kernels are built for AVX512-BF16 (``kernels/cpu/cpu_gemm.c``), the weight is packed into that
kernel's panels: a decode step streams every weight from DRAM, and that kernel prefetches the next panel
while it computes one, where oneDNN's waits on the stream. The panels live on transparent huge pages
(gpu/cpu/huge_pages.py), which saves the stream its TLB misses.
Its float32 sums run over k in order, so results can differ from ``F.linear``'s by one bf16 ulp in rare
elements (tests/kernels/cpu/test_gemm.py bounds the error against float64).

Elsewhere (oneDNN with bf16 but no AVX512-BF16 build), the weight is reordered once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does); that gives
``F.linear``'s bits without ``F.linear``'s re-laying of the weight on every call.
float32 weights are kept transposed ([in, out], TransposedLinear): MKL's sgemm runs F.linear's [out, in]
layout several times slower for the handful of rows a decode batch or a verified draft has.

``KernelConfig.cpu_linear`` picks: "auto" (cpu_gemm.c where built), "onednn", or "torch" (plain weights,
float32 too).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from aioengine.gpu.cpu import huge_pages
from aioengine.kernels.cpu import clib as cpu_kernels


@functools.cache
def _bf16_supported() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether a weight of this dtype can be packed here (bf16 on a CPU whose oneDNN has bf16 kernels)."""
    return weight.dtype == torch.bfloat16 and _bf16_supported()


def c_gemm_enabled() -> bool:
    """Whether cpu_gemm.c is built here (packed weights then take its layout unless told otherwise)."""
    return cpu_kernels.gemm_available()


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held packed for cpu_gemm.c, or in oneDNN's blocked layout (the plain
    weight is not kept). ``float32_out``: with cpu_gemm.c, return the float32 sums unrounded (the LM head:
    logits that round to the same bf16 no longer tie, so greedy follows the float32 model more often)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        batch_size_hint: int = 64,
        float32_out: bool = False,
        activation: str | None = None,
        c_gemm: bool | None = None,
    ) -> None:
        """``activation`` ("silu", "gelu_tanh"): a fused gate_up weight whose output is ``act(gate) * up``
        (half the width), from the GEMM's epilogue; only where ``fuses_activation`` says so. ``c_gemm``:
        cpu_gemm.c's layout (default: where it is built), else oneDNN's."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.c_gemm = c_gemm_enabled() if c_gemm is None else c_gemm
        assert activation is None or (self.c_gemm and self.fuses_activation(weight, bias, activation))
        self.activation = activation
        self.epilogue = (
            cpu_kernels.GEMM_ACT_MUL
            if activation is not None
            else cpu_kernels.GEMM_F32
            if float32_out and self.c_gemm
            else cpu_kernels.GEMM_BF16
        )
        if self.c_gemm:  # on huge pages: every decode step streams the whole weight
            numel = cpu_kernels.packed_gemm_weight_elems(*weight.shape)
            self.packed = cpu_kernels.pack_gemm_weight(
                weight, gated=activation is not None, out=huge_pages.zeros(numel, torch.bfloat16)
            )
        else:  # the hint picks a blocking; any number of rows runs on the result
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().contiguous(), batch_size_hint
            )
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.c_gemm:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        y = cpu_kernels.gemm(
            self._rows(x), self.packed, self.bias, self.out_features, self.epilogue, self.activation
        )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``x W^T + b`` (float32 sums) without writing the logits: cpu_gemm.c's
        epilogue; None where this layer is not packed for it."""
        if not self.c_gemm or self.epilogue == cpu_kernels.GEMM_ACT_MUL:
            return None
        return cpu_kernels.gemm(
            self._rows(x), self.packed, self.bias, self.out_features, cpu_kernels.GEMM_ARGMAX
        )

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the GEMM takes it: 2-D rows (the runner's batches already are) of unit inner stride."""
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        return flat if flat.stride(-1) == 1 else flat.contiguous()

    @staticmethod
    def fuses_activation(weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> bool:
        """Whether a gate_up weight can take the fused epilogue of cpu_gemm.c (an activation it has a table
        for, no bias, 64 | rows)."""
        return (
            activation in cpu_kernels.GATED_ACTIVATIONS
            and bias is None
            and weight.shape[0] % 64 == 0
            and packing_enabled(weight)
            and c_gemm_enabled()
        )

    def extra_repr(self) -> str:
        kind = "cpu_gemm" if self.c_gemm else "onednn"
        out = {
            cpu_kernels.GEMM_F32: ", float32 out",
            cpu_kernels.GEMM_ACT_MUL: f", {self.activation}_and_mul out",
        }
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, packed for {kind}"
            f"{out.get(self.epilogue, '')}"
        )


class TransposedLinear(nn.Module):
    """float32 ``y = x W^T + b`` from ``W^T`` held contiguous: sgemm on that layout keeps its speed at 2 to
    32 rows, where on F.linear's it falls to a fraction of it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_t = weight.detach().t().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = (
            torch.mm(flat, self.weight_t)
            if self.bias is None
            else torch.addmm(self.bias, flat, self.weight_t)
        )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, float32 transposed"


def pack_linears(model: nn.Module, mode: str = "auto", fuse_activations: bool = True) -> int:
    """Replace the model's bf16 ``nn.Linear`` layers (and a tied LM head) in place; returns how many.

    ``mode`` (``KernelConfig.cpu_linear``): "auto" packs for cpu_gemm.c where it is built, else for oneDNN;
    "onednn" always for oneDNN; "torch" packs nothing.

    A tied head gets a packed copy: the embedding lookup keeps the original table. The head gives float32
    logits where cpu_gemm.c runs it, and an MLP's fused gate_up projection takes over its gated activation
    (SiluAndMul, GeluTanhAndMul: it becomes an identity): the activation is the GEMM's epilogue, in torch's
    roundings (unless ``fuse_activations`` is off: LoRA adds its delta to gate_up before the activation).
    """
    if mode == "torch":
        return 0
    c_gemm = mode == "auto" and c_gemm_enabled()
    done = _transpose_float32_linears(model)
    for module in list(model.modules()):
        gate_up = getattr(module, "gate_up_proj", None)
        activation = getattr(getattr(module, "act_fn", None), "activation", None)
        if (
            c_gemm
            and fuse_activations
            and type(gate_up) is nn.Linear
            and PackedLinear.fuses_activation(gate_up.weight, gate_up.bias, activation)
        ):
            module.gate_up_proj = PackedLinear(gate_up.weight, None, activation=activation, c_gemm=True)
            module.act_fn = nn.Identity()
            done += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear | nn.Embedding) and packing_enabled(head.weight):
        model.lm_head = PackedLinear(
            head.weight, getattr(head, "bias", None), float32_out=True, c_gemm=c_gemm
        )
        done += 1
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and packing_enabled(child.weight):
                setattr(module, name, PackedLinear(child.weight, child.bias, c_gemm=c_gemm))
                done += 1
    return done


def _transpose_float32_linears(model: nn.Module) -> int:
    """float32 linears (and a tied float32 head, as a transposed copy: the embedding keeps its table) become
    TransposedLinear; returns how many."""
    done = 0
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear | nn.Embedding) and head.weight.dtype == torch.float32:
        model.lm_head = TransposedLinear(head.weight, getattr(head, "bias", None))
        done += 1
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(module, name, TransposedLinear(child.weight, child.bias))
                done += 1
    return done
