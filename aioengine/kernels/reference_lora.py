"""The torch reference of multi-LoRA: each adapter's rows of a batch add ``(x @ A^T) @ B^T`` to a linear's
output (Punica's shrink then expand, one adapter group at a time)."""

from __future__ import annotations

import torch


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    offsets: list[tuple[int, int]],
    groups: list[tuple[int, torch.Tensor]],
) -> None:
    """In place on ``out`` ``[T, N]``: for each ``(slot, rows)`` of ``groups`` and each part ``p`` (a slice
    ``offsets[p] = (first column, columns)`` of the output, e.g. q, k and v of a fused qkv), the rows gain
    ``x[rows] @ lora_a[p, slot]^T @ lora_b[p][slot]^T``. ``lora_a``: ``[P, S, R, K]``; ``lora_b[p]``:
    ``[S, columns, R]`` (the scaling folded in; a rank below R is zero-padded, an absent module is zeros)."""
    for slot, rows in groups:
        xs = x.index_select(0, rows)
        for p, (first, size) in enumerate(offsets):
            shrunk = xs @ lora_a[p, slot].t()
            out[:, first : first + size].index_add_(0, rows, shrunk @ lora_b[p][slot].t())
