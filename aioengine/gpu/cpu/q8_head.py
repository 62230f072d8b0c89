"""The LM head on its checkpoint's own Q8_0 codes, for CPU decode steps of a few rows.

GGUF files keep the token embedding (the tied head) in Q8_0 in the common quant mixes: int8 codes and one
scale per 32 inputs. A converted checkpoint holds those weights dequantized to float32, where
``code * scale`` is exact, so the codes come back exactly. At a vocabulary of 262k (Gemma 3) the head is
most of a decode step's weight bytes: its codes read 1.125 bytes a weight instead of bf16's 2 or float32's
4, through cpu_q8.c's integer dots (``q8.qgemv_f32``). The weight stays exact; the activations are
rounded once, per 4 inputs: to 3 bytes for a float32 model (about float32's own rounding), to 2 for a bf16
one (finer than the bf16 value in all but spans of more than 2^8 within 4 inputs).

A bf16 model's head keeps its packed GEMM for batches past ``MAX_ROWS_BF16`` rows, where the step is
compute-bound and the GEMM is faster. With VNNI (the avx512-bf16 level) a float32 model's head has no such
crossover in the batches measured (float32's GEMM reads 4 bytes a weight), so it keeps only the codes. Without
it (avx2, avx512, neon: several instructions a dot instead of one) the codes cost more per row, and at 16 and
64 rows the float32 GEMM measured faster (docs/benchmarks.md, per-ISA defaults): there the head keeps its GEMM
past ``MAX_ROWS_FLOAT32`` rows too. Where the level prefers float32 FMAs on codes (``q8.f32_fma``: x86
without VNNI), rows from ``FMA_FROM_ROWS`` to ``MAX_ROWS_FMA`` take cpu_q4_f32.c's 8-bit FMAs instead (x
uncut, the widened codes shared by 4 rows a pass, or panels widened once for all rows from 10), which
measured faster than both the integer dots and the GEMM there. A checkpoint whose head is not an exact Q8_0
dequantization keeps its GEMM.

A plain greedy step needs only each row's argmax: the dots screen every output with x cut to one byte and sum
exactly (the dots' limbs) only the outputs that could still win, so the pick is the exact dots' (cpu_q8.c).
That costs a third of the exact dots or less, and where the FMAs give the logits it stays faster up to
``SCREEN_MAX_ROWS_FMA`` rows (docs/benchmarks.md); there the pick is the dots' sums', which round apart from
the FMAs' logits by float32's rounding alone.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from aioengine.gpu.cpu import huge_pages
from aioengine.gpu.cpu.block_codes import block_codes
from aioengine.gpu.cpu.codes_cache import CheckpointCodes
from aioengine.kernels.cpu import clib, q8

logger = logging.getLogger(__name__)

BLOCK = 32
Q8_0 = (BLOCK, (127,))  # the head's kernel takes 32-input blocks; Q8_0 is what the common mixes give it
# Measured crossover with the bf16 head's packed GEMM (docs/benchmarks.md): past this many rows it is faster.
MAX_ROWS_BF16 = 4
# NEON (no VNNI, no FMAs on codes preferred): below the 16 rows where the float32 GEMM measured faster at avx2
# (at 1 row the codes' sample took about a third of the GEMM's); not measured on an ARM core.
MAX_ROWS_FLOAT32 = 4
# Where the level prefers FMAs on codes (x86 without VNNI): the dots up to 2 rows, the FMAs from 3 (on widened
# panels from 10, which led the float32 GEMM up to 128 rows), the GEMM past 256 (measured at avx2,
# docs/benchmarks.md).
FMA_FROM_ROWS, MAX_ROWS_FMA = 3, 256
# Where the FMAs give the logits, the screened argmax led their logits' argmax up to 24 rows (at avx2).
SCREEN_MAX_ROWS_FMA = 24
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # a tied head is the embedding


def q8_0_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes ``[N, K]``, float32 scales ``[N, K / 32]``) with ``codes * scale == weight`` bit for bit,
    where float32 ``weight [N, K]`` (K a multiple of 64) is a Q8_0 dequantization: each 32-input block's
    largest ``|w|`` is 127 times its scale, as the Q8_0 quantizer sets it. Else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    found = block_codes(lambda r0, r1: weight[r0:r1], n, k, kinds=[Q8_0])
    return None if found is None else (found.codes, found.scales)


def read_head_codes(codes: CheckpointCodes, tied: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``q8_0_codes`` of the checkpoint's head (the embedding when ``tied``), read a chunk of rows at a time
    from its float32 safetensors (or its kept codes); None when it has no such tensor or it is not Q8_0."""
    found = codes.read([_HEAD_NAMES[1] if tied else _HEAD_NAMES[0]], kinds=[Q8_0])
    return None if found is None else (found.codes, found.scales)


class Q8Head(nn.Module):
    """float32 logits (or each row's argmax) from the head's Q8_0 codes, activations cut to ``limbs``
    bytes; from ``fma_from`` rows (None: never) the 8-bit FMAs on x as it is, and the screened argmax up to
    ``screen_max`` rows; past ``max_rows`` rows (None: never) ``fallback``, the head's GEMM on its rounded
    weights, runs instead."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        limbs: int,
        fallback: nn.Module | None = None,
        max_rows: int | None = None,
        fma_from: int | None = None,
        screen_max: int = SCREEN_MAX_ROWS_FMA,
    ) -> None:
        super().__init__()
        assert limbs in (2, 3) and (fallback is None) == (max_rows is None)
        self.out_features, self.in_features = codes.shape
        assert scales.shape == (self.out_features, self.in_features // BLOCK)
        # On huge pages, as the GEMMs' weights: every decode step streams the whole head.
        self.packed = q8.pack(codes, out=huge_pages.zeros(codes.numel(), torch.uint8))
        self.scales = scales.contiguous()
        self.scale_max = q8.screen_scales(self.scales)
        self.screen_max = screen_max
        self.limbs = limbs
        self.fallback = fallback
        self.max_rows = max_rows
        self.fma_from = fma_from
        self.fma_packed = None if fma_from is None else q8.pack8_f32(codes.contiguous())

    def _fma(self, rows: int) -> bool:
        return self.fma_from is not None and rows >= self.fma_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.fallback is not None and self.max_rows is not None and flat.shape[0] > self.max_rows:
            return self.fallback(x)
        if self.fma_packed is not None and self._fma(flat.shape[0]):
            y = q8.q8f_gemv(self._rows(flat), self.fma_packed, self.scales)
        else:
            y = q8.qgemv_f32(self._rows(flat), self.packed, self.scales, limbs=self.limbs)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of the exact dots' sums (``forward(x)``'s below ``fma_from`` rows; first maximum,
        NaN wins) without writing the logits; None where the fallback runs and cannot pick it itself, or past
        ``screen_max`` rows where the FMAs give the logits."""
        flat = x.reshape(-1, self.in_features)
        if self.fallback is not None and self.max_rows is not None and flat.shape[0] > self.max_rows:
            argmax = getattr(self.fallback, "argmax", None)
            return argmax(x) if argmax is not None else None
        if self._fma(flat.shape[0]) and flat.shape[0] > self.screen_max:  # the caller takes forward's logits'
            return None
        return q8.qgemv_f32(
            self._rows(flat),
            self.packed,
            self.scales,
            argmax=True,
            limbs=self.limbs,
            scale_max=self.scale_max,
        )

    @staticmethod
    def _rows(flat: torch.Tensor) -> torch.Tensor:
        rows = flat.float()
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def extra_repr(self) -> str:
        rows = "every batch" if self.max_rows is None else f"up to {self.max_rows} rows"
        fma = "" if self.fma_from is None else f" (float32 FMAs from {self.fma_from} rows)"
        return f"{self.in_features}, {self.out_features}, q8_0 codes for {rows}, x in {self.limbs} bytes{fma}"


def attach_q8_head(model: nn.Module, codes: CheckpointCodes) -> bool:
    """Give ``model`` a Q8Head in front of its (already packed) head where the checkpoint's head is Q8_0
    and this CPU runs the kernel vectorized; returns whether it did."""
    head = getattr(model, "lm_head", None)
    if head is None or not q8.available():
        return False
    found = read_head_codes(codes, bool(getattr(model, "tie_word_embeddings", False)))
    if found is None:
        return False
    head_codes, scales = found
    if head_codes.shape[0] != getattr(head, "out_features", getattr(head, "num_embeddings", -1)):
        return False
    if isinstance(head, nn.Embedding):  # a tied head left unpacked: its fallback is the table as a linear
        table = head
        head = nn.Linear(table.embedding_dim, table.num_embeddings, bias=False, device="meta")
        head.weight = table.weight
    if next(model.parameters()).dtype != torch.float32:
        model.lm_head = Q8Head(head_codes, scales, limbs=2, fallback=head, max_rows=MAX_ROWS_BF16)
    elif clib.loaded_level() == "avx512-bf16":
        model.lm_head = Q8Head(head_codes, scales, limbs=3)  # the float32 GEMM's copy of the head is freed
    elif q8.f32_fma():
        model.lm_head = Q8Head(
            head_codes, scales, limbs=3, fallback=head, max_rows=MAX_ROWS_FMA, fma_from=FMA_FROM_ROWS
        )
    else:
        model.lm_head = Q8Head(head_codes, scales, limbs=3, fallback=head, max_rows=MAX_ROWS_FLOAT32)
    nbytes = head_codes.numel() + scales.numel() * 4
    logger.info("LM head: %s (%d MB)", model.lm_head.extra_repr(), nbytes >> 20)
    return True
