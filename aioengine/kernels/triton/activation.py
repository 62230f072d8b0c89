"""SiluAndMul for the fused gate_up projection as a Triton kernel (reference: ``reference.silu_and_mul``).

``out = silu(x[..., :d]) * x[..., d:]``, rounding like torch (silu's result, then the product, each to
the activation dtype). Importing this module imports triton; only the CUDA backend does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioengine.kernels.triton.utils import cast_to, interpreted


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, d, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = cast_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRET).to(tl.float32)
    tl.store(out_ptr + row * d + cols, cast_to(silu * up, dtype, INTERPRET), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.silu_and_mul`` for ``x`` ``[..., 2d]`` whose rows are contiguous."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view for the [T, 2d] output of a linear layer
    assert x2.stride(-1) == 1
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0 and d > 0:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            out, x2, x2.stride(0), d, BLOCK=block, INTERPRET=interpreted(_silu_and_mul_kernel)
        )
    return out
