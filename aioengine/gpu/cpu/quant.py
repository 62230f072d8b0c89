"""Weight-only int8/int4 quantization of the linear layers, for CPU decoding bound by DRAM bandwidth.

A decode step of a small batch reads every weight once and does little arithmetic with it, so its
time is the weights' bytes over the memory bandwidth: 4-bit codes read 4x fewer bytes than bf16.
torch's CPU kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) dequantize in
registers, but their cost grows with every row of the batch; above ``max_rows_quantized`` rows a
step is compute-bound and a plain GEMM on the dequantized weights is several times faster. So a
quantized layer keeps both: the codes for small batches and their dequantized values (the same
numbers, rounded to the model dtype) for large ones. Both paths compute with the quantized model.

int4 is asymmetric round-to-nearest per group of 32 inputs, ``w = (q - 8) * scale + zero`` with
``q`` in 0..15 (GGUF's Q4_1 and the default model's source format: it re-quantizes losslessly).
int8 is symmetric per output channel, ``w = q * scale`` with ``q`` in -127..127.
float32 activations take the C kernels for a few rows where the ISA level vectorizes them: int4 as affine
4-bit block codes (``q * scale + (zero - 8 scale)``, cpu_q8.c, as a GGUF's Q4_1), int8 through cpu_qgemv.c.
torch's int4 kernel is fast only with AVX-512; on an AVX2 core it ran 3x slower than the unquantized model.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn.functional as F
from torch import nn

from aioengine.gpu.cpu.linear import PackedLinear, c_gemm_enabled, packing_enabled
from aioengine.gpu.models.moe import CodedExperts, Experts
from aioengine.kernels.cpu import clib, q8

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZE = 32
# Measured crossover (docs/benchmarks.md): past this many rows the dequantized GEMM is faster.
MAX_ROWS_QUANTIZED = 8


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """``weight [N, K]`` -> (codes ``int32 [N, K]`` in 0..15, scale ``[N, K/g]``, zero ``[N, K/g]``), fp32."""
    n, k = weight.shape
    w = weight.float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: any scale works
    q = ((w - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return q.view(n, k), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the codes stand for."""
    n, k = q.shape
    g = k // scale.shape[1]
    return ((q.view(n, -1, g).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (codes ``int8 [N, K]``, per-channel scale ``[N]`` fp32)."""
    w = weight.float()
    scale = w.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` for a quantized ``W``: the packed kernel for a few rows, a GEMM for many."""

    packed: torch.Tensor  # buffers, registered in __init__
    scales_zeros: torch.Tensor
    weight: nn.Parameter | None

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        method: str,
        max_rows_quantized: int = MAX_ROWS_QUANTIZED,
        linear: str = "auto",
        c_kernels: bool = True,
        keep_dequantized: bool = True,
    ) -> None:
        """``linear``: how the large-batch GEMM runs (``KernelConfig.cpu_linear``); ``c_kernels``: int8 with
        float32 activations takes cpu_qgemv.c for a few rows, where it is built; ``keep_dequantized=False``:
        every batch takes the codes and no dequantized copy is kept (a mixture's experts: most of the
        model's bytes, each seeing a few rows a step)."""
        super().__init__()
        assert method in QUANTIZATION_METHODS, method
        assert weight.device.type == "cpu", "the packed kernels are CPU kernels"
        dtype = weight.dtype
        self.method = method
        self.out_features, self.in_features = weight.shape
        self.max_rows_quantized = max_rows_quantized
        c_rows = dtype == torch.float32 and c_kernels and clib.load() is not None
        # int4 on the affine block-code kernel: packed holds the codes, scales_zeros the scale per 32 and
        # this the offset per 32 (None: torch's int4 kernel and its layout)
        self.int4_mins: torch.Tensor | None = None
        self.fma = False
        if method == "int4":
            q, scale, zero = quantize_int4(weight)
            dequantized = dequantize_int4(q, scale, zero)
            if c_rows and q8.available() and self.in_features % 64 == 0:
                codes = q.to(torch.uint8).contiguous()
                self.fma = q8.f32_fma()  # float32 FMAs on the codes (cpu_q4_f32.c), else the integer dots
                packed = q8.pack4_f32(codes) if self.fma else q8.pack4(codes)
                self.register_buffer("packed", packed, persistent=False)
                self.register_buffer("scales_zeros", scale, persistent=False)
                self.int4_mins = zero - 8 * scale
            else:
                packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
                self.register_buffer("packed", packed, persistent=False)
                # The kernel's layout: [K / group, N, (scale, zero)], in the activations' dtype.
                scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).contiguous().to(dtype)
                self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        else:
            q, scale = quantize_int8(weight)
            dequantized = q.float() * scale[:, None]
            self.register_buffer("packed", q, persistent=False)
            self.register_buffer("scales_zeros", scale.to(dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.c_gemv = method == "int8" and c_rows
        self.gemm = None
        if not keep_dequantized:
            self.weight = None
            self.max_rows_quantized = sys.maxsize
            return
        self.weight = nn.Parameter(dequantized.to(dtype), requires_grad=False)
        # Large batches: the same dequantized values, prepacked for oneDNN when bf16 (same bits, faster).
        if linear != "torch" and packing_enabled(self.weight):
            self.gemm = PackedLinear(self.weight, self.bias, c_gemm=linear == "auto" and c_gemm_enabled())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the runner's batches are 2-D
        if flat.shape[0] > self.max_rows_quantized:
            assert self.weight is not None  # kept wherever rows past max_rows_quantized can come
            return self.gemm(x) if self.gemm is not None else F.linear(x, self.weight, self.bias)
        if self.int4_mins is not None and flat.stride(-1) == 1 and flat.dtype == torch.float32:
            if self.fma:
                y = q8.q4f_gemv(flat, self.packed, self.scales_zeros, self.int4_mins, self.bias)
            else:
                y = q8.qgemv_f32(
                    flat, self.packed, self.scales_zeros, 32, self.bias, limbs=3, mins=self.int4_mins
                )
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.c_gemv and flat.stride(-1) == 1:
            y = clib.qgemv_int8(flat, self.packed, self.scales_zeros, self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if self.method == "int4":
            y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, INT4_GROUP_SIZE, self.scales_zeros)
        else:
            y = torch._weight_int8pack_mm(flat, self.packed, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, method={self.method}"


def can_quantize(weight_shape: torch.Size, method: str) -> bool:
    """The kernels' shape rules for a ``[N, K]`` weight: int4 needs K a multiple of the group, N of 16."""
    n, k = weight_shape
    if method == "int4":
        return k % INT4_GROUP_SIZE == 0 and n % 16 == 0
    return True


def quantize_model(model: nn.Module, method: str, linear: str = "auto", c_kernels: bool = True) -> int:
    """Replace the decoder's linear layers (a mixture's experts too, not its router) and the LM head in
    place; returns how many were quantized.

    A tied head gets its own quantized copy: the embedding lookup keeps the original table.
    """
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"quantization={method!r} is a CPU option (its kernels are CPU kernels)")
    done = skipped = 0

    def make(weight: torch.Tensor) -> QuantizedLinear:  # an expert's: its codes only
        return QuantizedLinear(
            weight, None, method, linear=linear, c_kernels=c_kernels, keep_dequantized=False
        )

    for module in list(model.modules()):
        if isinstance(module, CodedExperts):  # a GGUF's experts: on the file's codes already
            skipped += 2 * module.num_experts
            continue
        if isinstance(module, Experts):  # a mixture's experts: each expert's own linears
            assert module.w13 is not None and module.w2 is not None  # quantized once
            w13, w2 = module.w13.weight, module.w2.weight
            if can_quantize(w13.shape[1:], method) and can_quantize(w2.shape[1:], method):
                done += module.quantize(make)
            else:
                skipped += 2 * module.num_experts
            continue
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear:
                continue
            if not can_quantize(child.weight.shape, method):
                skipped += 1
                continue
            setattr(
                module,
                name,
                QuantizedLinear(child.weight.data, child.bias, method, linear=linear, c_kernels=c_kernels),
            )
            done += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Embedding):  # tied: quantize a copy for the logits
        if can_quantize(head.weight.shape, method):
            model.lm_head = QuantizedLinear(
                head.weight.data, None, method, linear=linear, c_kernels=c_kernels
            )
            done += 1
        else:
            skipped += 1
    if skipped:
        logger.warning(
            "quantization %s: %d linear layers kept unquantized (shapes the kernel rejects, or experts on "
            "a GGUF's block codes already)",
            method,
            skipped,
        )
    return done
