"""A mixture's experts on their GGUF block codes in the CPU's C kernels: each expert's gate_up and down read
only the expert's own codes, for whatever rows chose it.

The tokens are grouped by expert (``reference_moe.fused_moe_by_expert``), so a decode step of B tokens reads
at most B x top-k experts, each once. The codes are the file's (model/gguf_codes.py), in the kernels' layout
(affine 4-bit ones in cpu_q4_f32.c's FMA layout, a whole layer at a time by its fused op; symmetric ones
expert by expert on cpu_q8.c's integer dots), and no float copy is kept: an expert sees few rows in decode,
and a prompt's rows split over the experts as well.
"""

from __future__ import annotations

import functools
import logging
from typing import cast

import torch
from torch import nn

from aioengine.gpu.cpu import huge_pages
from aioengine.gpu.models.moe import CodedExperts
from aioengine.kernels.cpu import q8

logger = logging.getLogger(__name__)


class CodedLinear(nn.Module):
    """``x @ W.T`` for ``W = codes * scales (+ mins)`` per block, on the codes alone, for any rows."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        block: int,
        fma: bool | None = None,
    ):
        """``fma``: affine codes in cpu_q4_f32.c's layout for its FMAs (default: where the level wants)."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.block = block
        self.fma = mins is not None and (q8.f32_fma() if fma is None else fma)
        codes = codes.contiguous()
        if mins is None:
            self.packed = q8.pack(codes, block, out=huge_pages.zeros(codes.numel(), torch.uint8))
        else:
            pack = q8.pack4_f32 if self.fma else q8.pack4
            self.packed = pack(codes, out=huge_pages.zeros(codes.numel() // 2, torch.uint8))
        # copies, not views: the checkpoint's stacked tensors (its file's mapping) go once all are built
        self.scales = _copy(scales)
        self.mins = None if mins is None else _copy(mins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if self.fma:
            assert self.mins is not None  # fma: affine codes
            y = q8.q4f_gemv(rows, self.packed, self.scales, self.mins)
        else:
            y = q8.qgemv_f32(rows, self.packed, self.scales, self.block, limbs=3, mins=self.mins)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "4-bit affine" if self.mins is not None else "int8"
        return f"{self.in_features}, {self.out_features}, {kind} block codes of {self.block}"


class FusedCodes:
    """A layer's experts for cpu_q4_f32.c's fused op (``q8.moe_q4f``): the address table of every expert's
    codes, scales and mins, and the intermediate size. Its linears own the memory."""

    __slots__ = ("intermediate", "linears", "tables")

    def __init__(self, linears: nn.ModuleList) -> None:
        gate_up, down = list(linears[0::2]), list(linears[1::2])
        self.linears = linears
        self.intermediate = int(cast(CodedLinear, down[0]).in_features)
        attrs = ("packed", "scales", "mins")
        rows = [[getattr(lin, a).data_ptr() for lin in group] for group in (gate_up, down) for a in attrs]
        self.tables = torch.tensor(rows, dtype=torch.int64)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return huge_pages.zeros(t.numel(), t.dtype).view(t.shape).copy_(t)


def attach_coded_experts(model: nn.Module) -> int:
    """Turn each layer's ``CodedExperts`` into C-kernel linears, where this CPU runs the kernels vectorized
    (else they stay on the torch path, dequantizing each expert for its rows); returns how many linears."""
    if not q8.available():
        return 0
    done = nbytes = 0
    for module in model.modules():
        if not isinstance(module, CodedExperts) or module.linears is not None:
            continue
        if any(k % 64 for _, k in module.shapes.values()):
            continue  # the kernels take inputs in runs of 64; a tensor-parallel rank's part may not be
        # affine 4-bit codes in the FMA layout at every level, for the fused op (measured faster than the
        # integer dots expert by expert at the avx2 and avx512-bf16 levels, batch 1 and 16)
        done += module.to_linears(functools.partial(CodedLinear, fma=True))
        assert module.linears is not None
        if all(linear.fma for linear in module.linears):
            module.fused = FusedCodes(module.linears)
        for linear in module.linears:
            extra = 0 if linear.mins is None else linear.mins.numel() * 4
            nbytes += linear.packed.numel() + linear.scales.numel() * 4 + extra
    if done:
        logger.info("%d experts' linears on their GGUF block codes (%d MB)", done, nbytes >> 20)
    return done
