"""Linear layers with oneDNN-prepacked bf16 weights on the CPU: the same bits as ``F.linear``, fewer cycles.

``F.linear`` on a plain bf16 weight re-lays the weight out for oneDNN's micro-kernel on every call; a
weight reordered once at load time (``mkldnn._reorder_linear_weight``, what inductor's freezing pass
does) skips that. Measured on the 2-core dev machine (docs/benchmarks.md): 1.5-2x faster for 1-128 rows,
still ahead at 512. The products are summed in the same order, so outputs equal ``F.linear``'s bit for
bit (tests/engine/test_cpu_linear.py), which keeps bf16 greedy parity. float32 is left alone: there the
packed path sums in another order than MKL's sgemm, and float32 is the dtype of the parity tests.

``AIOENGINE_PACKED_LINEAR=0`` keeps plain weights (to measure the difference).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn


@functools.cache
def _bf16_supported() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_enabled(weight: torch.Tensor) -> bool:
    """Whether a weight of this dtype/device gets packed (bf16 on a CPU whose oneDNN has bf16 kernels)."""
    return (os.environ.get("AIOENGINE_PACKED_LINEAR", "1") != "0" and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16 and _bf16_supported())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (the plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int = 64) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        # The hint picks a blocking; any number of rows runs on the result.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_size_hint)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, packed"


def pack_linears(model: nn.Module) -> int:
    """Replace the model's bf16 ``nn.Linear`` layers (and a tied LM head) in place; returns how many.

    A tied head gets a packed copy: the embedding lookup keeps the original table.
    """
    done = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and packing_enabled(child.weight):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                done += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Embedding) and packing_enabled(head.weight):
        model.lm_head = PackedLinear(head.weight, None)
        done += 1
    return done
