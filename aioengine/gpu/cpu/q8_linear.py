"""A model's decoder linears on their GGUF block codes, for CPU steps of a few rows (bf16 and float32).

In GGUF's common quant mixes most of a layer's weights are symmetric block types (Q5_0 or Q8_0 for q, k,
v, gate and up; Q6_K for some down projections): exact as int8 codes with a scale per 32 or 16 inputs
(gpu/cpu/block_codes.py). Q4_1 and Q4_K tensors hold 4-bit codes with a scale and an offset per 32. At a
few rows a decode step streams every weight from DRAM, and the codes are 0.75-1.25 bytes a weight against
bf16's 2 or float32's 4 (cpu_q8.c). The weight is the file's, unrounded;
the activations are cut to 2 bytes per input for bf16 (finer than their bf16 values except where 4 inputs
span more than 2^8; 4-bit codes on AVX512-BF16 take them uncut, cpu_q4_bf16.c) and 3 for float32 (about
float32's own rounding).
The kernel's arithmetic per weight is several times the bf16 GEMM's, so past a few rows (``MAX_ROWS``, the
crossovers measured per dtype and block size) the model's own linear, kept beside the codes, runs: the
packed bf16 GEMM, or float32's transposed one (which reads 4 bytes a weight: where the level takes FMAs on
4-bit codes it runs only prompts, which never take the codes, and decode steps past MAX_ROWS_FMA rows).
Only steps of decodes take the codes (``CodedSteps``): a prompt's rows go through the GEMM however few they
are, so its KV, pooled embedding and prompt logprobs do not depend on what else shared its step. The bf16
decode stack (cpu_decode_stack.c) makes the same choice with the same kernels, so both paths keep one
result.
"""

from __future__ import annotations

import logging
from typing import Any, TypeGuard, cast

import torch
from torch import nn

from aioengine.gpu.cpu import huge_pages
from aioengine.gpu.cpu.block_codes import BlockCodes
from aioengine.gpu.cpu.codes_cache import CheckpointCodes
from aioengine.gpu.cpu.linear import PackedLinear, TransposedLinear
from aioengine.gpu.models.llama import FUSED_SHARDS
from aioengine.kernels.cpu import q8

logger = logging.getLogger(__name__)

# Rows up to which the codes run, by (dtype, block size): the measured crossovers (docs/benchmarks.md).
MAX_ROWS = {
    (torch.bfloat16, 32): 2,
    (torch.bfloat16, 16): 1,
    (torch.float32, 32): 16,
    (torch.float32, 16): 16,
}
# bf16 rows against 4-bit codes with bf16 dots (cpu_q4_bf16.c): their arithmetic is near the GEMM's, so they
# lead up to about 8 rows, cover a verified query of 1 + 8 and lose at 16 (docs/benchmarks.md)
MAX_ROWS_TILES = 9
# float32 rows on 4-bit codes with FMAs: from 10 rows cpu_q4_f32.c widens panels of the weights once for all
# rows and runs a GEMM micro-kernel on them, which led the float32 GEMM at 16 to 128 rows (avx2,
# docs/benchmarks.md); a decode step wider than this keeps the GEMM
MAX_ROWS_FMA = 256
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class CodedSteps:
    """Whether the step running now is decodes only: one per model, shared by its Q8Linears and set by the
    backend before each forward (a module called on its own, as in tests, counts as a decode)."""

    __slots__ = ("decodes_only",)

    def __init__(self) -> None:
        self.decodes_only = True


class Q8Linear(nn.Module):
    """``gemm``'s linear (bias and a fused activation included) on the weight's block codes for up to
    ``max_rows`` rows, ``gemm`` itself past them: a packed bf16 linear, or a float32 transposed one."""

    def __init__(
        self,
        found: BlockCodes,
        gemm: PackedLinear | TransposedLinear,
        max_rows: int | None = None,
        steps: CodedSteps | None = None,
    ) -> None:
        super().__init__()
        self.steps = CodedSteps() if steps is None else steps
        assert _takes(gemm)
        assert found.codes.shape == (gemm.out_features, gemm.in_features)
        self.gemm = gemm
        self.out_features, self.in_features = gemm.out_features, gemm.in_features
        self.dtype = torch.bfloat16 if isinstance(gemm, PackedLinear) else torch.float32
        self.bias, self.activation = gemm.bias, getattr(gemm, "activation", None)
        self.block = found.block
        codes, scales, mins = found.codes, found.scales, found.mins
        self.tiles = mins is not None and self.dtype == torch.bfloat16 and q8.bf16_dots()
        # float32 rows on 4-bit codes: float32 FMAs where they beat the integer dots (cpu_q4_f32.c)
        self.fma = mins is not None and self.dtype == torch.float32 and q8.f32_fma()
        default_rows = (
            MAX_ROWS_TILES if self.tiles else MAX_ROWS_FMA if self.fma else MAX_ROWS[self.dtype, self.block]
        )
        self.max_rows = default_rows if max_rows is None else max_rows
        if self.activation is not None:  # gate/up row pairs: the kernel's epilogue sees both halves at once
            codes, scales = _pairs(codes), _pairs(scales)
            mins = None if mins is None else _pairs(mins)
        if mins is None:
            self.packed = q8.pack(
                codes.contiguous(), self.block, out=huge_pages.zeros(codes.numel(), torch.uint8)
            )
        elif self.fma:
            self.packed = q8.pack4_f32(
                codes.contiguous(), out=huge_pages.zeros(codes.numel() // 2, torch.uint8)
            )
        elif self.tiles:  # bf16 dots on x as it is (cpu_q4_bf16.c), in its own layout
            n16 = -(-self.out_features // 16) * 16
            out = huge_pages.zeros(n16 * self.in_features // 2, torch.uint8)
            self.packed, scales, mins = q8.pack4_tiles(codes.contiguous(), scales, mins, out=out)
        else:
            self.packed = q8.pack4(codes.contiguous(), out=huge_pages.zeros(codes.numel() // 2, torch.uint8))
        self.scales = scales.contiguous()
        self.mins = None if mins is None else mins.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows or not self.steps.decodes_only:
            return self.gemm(x)
        rows = flat.to(self.dtype)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        if self.fma:
            assert self.mins is not None  # fma: affine codes
            y = q8.q4f_gemv(rows, self.packed, self.scales, self.mins, self.bias)
        elif self.dtype == torch.float32:
            y = q8.qgemv_f32(rows, self.packed, self.scales, self.block, self.bias, limbs=3, mins=self.mins)
        else:
            y = q8.qgemv_bf16(
                rows,
                self.packed,
                self.scales,
                self.block,
                self.bias,
                self.activation,
                mins=self.mins,
                n_out=self.out_features if self.tiles else None,
            )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        act = "" if self.activation is None else f", {self.activation}_and_mul out"
        kind = "4-bit affine" if self.mins is not None else "int8"
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, {kind} block codes of "
            f"{self.block} for up to {self.max_rows} rows{act}, else {self.gemm.extra_repr()}"
        )


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """A fused gate_up's rows as [gate_0, up_0, gate_1, up_1, ...]."""
    half = t.shape[0] // 2
    return torch.stack((t[:half], t[half:]), 1).reshape(t.shape)


def module_bytes(linear: Q8Linear) -> int:
    """What a Q8Linear's codes take in memory (its GEMM's weight aside)."""
    extra = 0 if linear.mins is None else linear.mins.numel() * 4
    return linear.packed.numel() + linear.scales.numel() * 4 + extra


def _takes(gemm: object) -> TypeGuard[PackedLinear | TransposedLinear]:
    """A linear whose codes the kernels can stand in for: packed bf16 (cpu_gemm.c's layout) or float32."""
    if isinstance(gemm, PackedLinear):
        return gemm.c_gemm and gemm.dtype == torch.bfloat16
    return isinstance(gemm, TransposedLinear)


def attach_q8_linears(model: nn.Module, codes: CheckpointCodes) -> int:
    """Put a Q8Linear in front of each decoder linear (packed bf16, or float32) whose checkpoint weights
    have exact block codes, where this CPU runs the kernels vectorized; returns how many."""
    if not q8.available():
        return 0
    done, nbytes = 0, 0
    steps = CodedSteps()
    for name, module in list(model.named_modules()) if codes.matrices else []:
        for attr in _LINEARS:
            gemm = getattr(module, attr, None)
            if not _takes(gemm):
                continue
            shards = FUSED_SHARDS.get(attr, (attr,))
            names = [f"{name}.{shard}.weight" for shard in shards]
            found = codes.read(names, affine=True)
            if found is None or found.codes.shape != (gemm.out_features, gemm.in_features):
                continue
            setattr(module, attr, Q8Linear(found, gemm, steps=steps))
            done += 1
            nbytes += module_bytes(getattr(module, attr))
    if done:
        cast(Any, model).coded_steps = steps  # the backend marks each step
        logger.info("%d decoder linears on their GGUF block codes for few rows (%d MB)", done, nbytes >> 20)
    return done
