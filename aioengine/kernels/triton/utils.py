"""Helpers shared by the Triton kernels (importing this module imports triton).

Two gaps of Triton's CPU interpreter (``TRITON_INTERPRET=1``, the CI proof path) are bridged here
rather than skipped in tests: its fp32 -> bf16 cast truncates where the GPU rounds to nearest even,
and its ``tl.dot`` reads bf16 operands as raw integers (numpy has no bf16). Kernels take an
``INTERPRET`` constexpr; on a GPU it is False and the helpers compile to the plain operations.
"""

from __future__ import annotations

import triton
import triton.language as tl


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


@triton.jit
def cast_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    """``x.to(dtype)`` with round-to-nearest-even, the GPU's rounding, under the interpreter too."""
    if INTERPRET and dtype == tl.bfloat16:
        # Round the fp32 bits to the nearest even bf16 by hand; the truncating cast is then exact.
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
