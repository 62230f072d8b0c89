"""A model's decoder linears on their GGUF block codes, for CPU steps of a few rows (bf16 and float32).

In GGUF's common quant mixes most of a layer's weights are symmetric block types (Q5_0 or Q8_0 for q, k,
v, gate and up; Q6_K for some down projections): exact as int8 codes with a scale per 32 or 16 inputs
(gpu/cpu/block_codes.py). At a few rows a decode step streams every weight from DRAM, and the codes are
1.125-1.25 bytes a weight against bf16's 2 or float32's 4 (cpu_q8.c). The weight is the file's, unrounded;
the activations are cut to 2 bytes per input for bf16 (finer than their bf16 values except where 4 inputs
span more than 2^8) and 3 for float32 (about float32's own rounding).
The kernel's arithmetic per weight is several times the bf16 GEMM's, so past a few rows (``MAX_ROWS``, the
crossovers measured per dtype and block size) the model's own linear, kept beside the codes, runs: the
packed bf16 GEMM, or float32's transposed one (which reads 4 bytes a weight and loses until about 16 rows).
The bf16 decode stack (cpu_decode_stack.c) makes the same choice with the same kernels, so both paths keep
one result.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from aioengine.gpu.cpu import huge_pages
from aioengine.gpu.cpu.block_codes import BlockCodes, float32_matrices, read_block_codes
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
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Q8Linear(nn.Module):
    """``gemm``'s linear (bias and a fused activation included) on the weight's block codes for up to
    ``max_rows`` rows, ``gemm`` itself past them: a packed bf16 linear, or a float32 transposed one."""

    def __init__(
        self, found: BlockCodes, gemm: PackedLinear | TransposedLinear, max_rows: int | None = None
    ) -> None:
        super().__init__()
        assert _takes(gemm)
        assert found.codes.shape == (gemm.out_features, gemm.in_features)
        self.gemm = gemm
        self.out_features, self.in_features = gemm.out_features, gemm.in_features
        self.dtype = torch.bfloat16 if isinstance(gemm, PackedLinear) else torch.float32
        self.bias, self.activation = gemm.bias, getattr(gemm, "activation", None)
        self.block = found.block
        self.max_rows = MAX_ROWS[self.dtype, self.block] if max_rows is None else max_rows
        codes, scales = found.codes, found.scales
        if self.activation is not None:  # gate/up row pairs: the kernel's epilogue sees both halves at once
            half = self.out_features // 2
            codes = torch.stack((codes[:half], codes[half:]), 1).reshape(codes.shape)
            scales = torch.stack((scales[:half], scales[half:]), 1).reshape(scales.shape)
        self.packed = q8.pack(
            codes.contiguous(), self.block, out=huge_pages.zeros(codes.numel(), torch.uint8)
        )
        self.scales = scales.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.max_rows:
            return self.gemm(x)
        rows = flat.to(self.dtype)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        if self.dtype == torch.float32:
            y = q8.qgemv_f32(rows, self.packed, self.scales, self.block, self.bias, limbs=3)
        else:
            y = q8.qgemv_bf16(rows, self.packed, self.scales, self.block, self.bias, self.activation)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        act = "" if self.activation is None else f", {self.activation}_and_mul out"
        return (
            f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, block codes of "
            f"{self.block} for up to {self.max_rows} rows{act}, else {self.gemm.extra_repr()}"
        )


def _takes(gemm: object) -> bool:
    """A linear whose codes the kernels can stand in for: packed bf16 (cpu_gemm.c's layout) or float32."""
    if isinstance(gemm, PackedLinear):
        return gemm.c_gemm and gemm.dtype == torch.bfloat16
    return isinstance(gemm, TransposedLinear)


def attach_q8_linears(model: nn.Module, checkpoint: str | os.PathLike[str]) -> int:
    """Put a Q8Linear in front of each decoder linear (packed bf16, or float32) whose checkpoint weights
    have exact block codes, where this CPU runs the kernels vectorized; returns how many."""
    if not q8.available():
        return 0
    done, nbytes = 0, 0
    with float32_matrices(checkpoint) as matrices:
        for name, module in list(model.named_modules()) if matrices else []:
            for attr in _LINEARS:
                gemm = getattr(module, attr, None)
                if not _takes(gemm):
                    continue
                shards = FUSED_SHARDS.get(attr, (attr,))
                found = read_block_codes(matrices, [f"{name}.{shard}.weight" for shard in shards])
                if found is None or found.codes.shape != (gemm.out_features, gemm.in_features):
                    continue
                setattr(module, attr, Q8Linear(found, gemm))
                done += 1
                nbytes += found.codes.numel() + found.scales.numel() * 4
    if done:
        logger.info("%d decoder linears on their GGUF block codes for few rows (%d MB)", done, nbytes >> 20)
    return done
