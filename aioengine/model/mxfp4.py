"""MXFP4 (OCP microscaling FP4) block codes, as gpt-oss's safetensors store its experts: exact float32."""

from __future__ import annotations

import torch

# The 16 E2M1 codes' values: sign bit, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 (two codes a byte, the low nibble first) and ``scales [..., G]`` uint8
    (E8M0: 2^(s - 127)) -> float32 ``[..., G * 32]``: each block of 32 values times its power of two, exactly
    (every value is a float32)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} (16 bytes a block)"
        )
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)
