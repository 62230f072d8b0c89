"""Tiny checkpoints whose projections are exact GGUF block-code dequantizations (tests of the Q8 paths)."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize


def as_block_codes(hf: torch.nn.Module, seed: int = 0, q4_1: bool = False) -> None:
    """Make the model's projection weights exact block-code dequantizations, as a GGUF's common mixes hold
    them: Q5_0 and Q8_0 in turn (blocks of 32), the down projections Q6_K-like (a float16 scale times an
    int8 sub-scale per 16 inputs, codes in [-32, 31]); with ``q4_1`` all of them Q4_1 (4-bit codes with a
    scale and an offset per 32, as the default model's file)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (name, p) in enumerate(n for n in hf.named_parameters() if n[0].endswith("_proj.weight")):
            n, k = p.shape
            if q4_1:
                raw = quantize(p.detach().numpy().astype(np.float32), Q.Q4_1)
                p.copy_(torch.from_numpy(dequantize(raw, Q.Q4_1).reshape(n, k)))
            elif "down_proj" in name:
                d = (torch.rand(n, k // 16, generator=g) * 2e-3).half().float()
                scale = d * torch.randint(1, 128, (n, k // 16), generator=g)
                codes = torch.randint(-32, 32, (n, k), generator=g)
                p.copy_((codes.view(n, -1, 16) * scale[..., None]).view(n, k))
            else:
                qtype = (Q.Q5_0, Q.Q8_0)[i % 2]
                raw = quantize(p.detach().numpy().astype(np.float32), qtype)
                p.copy_(torch.from_numpy(dequantize(raw, qtype).reshape(n, k)))


def attach_codes(model, checkpoint) -> int:
    """``attach_q8_linears`` on the checkpoint's codes, as the backend calls it."""
    from aioengine.gpu.cpu.codes_cache import checkpoint_codes
    from aioengine.gpu.cpu.q8_linear import attach_q8_linears

    with checkpoint_codes(checkpoint) as codes:
        return attach_q8_linears(model, codes)
