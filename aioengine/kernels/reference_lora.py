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


def add_lora_masked(
    out: torch.Tensor, x: torch.Tensor, a_flat: torch.Tensor, b_flat: torch.Tensor, mask: torch.Tensor
) -> None:
    """``add_lora``'s sum as two large products. Every row shrinks through every part's and slot's A at
    once (``a_flat`` ``[P * S * R, K]``); the slots other than its own are masked out (``mask``
    ``[T, S * R]``: 1 over its slot's rank, 0 elsewhere and on the base model's rows); one product with
    the parts' B laid block-diagonally (``b_flat`` ``[P * S * R, N]``: part p's rows write only its
    columns) adds every part's delta. No host sync, no per-adapter loop: any mix of adapters costs the
    same two GEMMs, and a CUDA graph can hold them."""
    rows, width = mask.shape
    shrunk = (x @ a_flat.t()).view(rows, -1, width)
    out.addmm_((shrunk * mask[:, None, :]).view(rows, -1), b_flat)


def block_diagonal_b(lora_b: list[torch.Tensor]) -> torch.Tensor:
    """``add_lora``'s per-part ``lora_b`` (``[S, columns, R]`` each) as ``add_lora_masked``'s ``b_flat``."""
    num_slots, _, rank = lora_b[0].shape
    width = sum(b.shape[1] for b in lora_b)
    out = lora_b[0].new_zeros(len(lora_b) * num_slots * rank, width)
    first = 0
    for p, b in enumerate(lora_b):
        block = slice(p * num_slots * rank, (p + 1) * num_slots * rank)
        out[block, first : first + b.shape[1]] = b.permute(0, 2, 1).reshape(num_slots * rank, b.shape[1])
        first += b.shape[1]
    return out
