"""The LoRA op: the masked products every backend runs equal the per-adapter torch reference, with uneven
groups, an adapter without rows, base-model rows, ranks 8 and 64, and fused outputs of several parts."""

from __future__ import annotations

import pytest
import torch

from aioengine.kernels.reference_lora import add_lora, add_lora_masked, block_diagonal_b


@pytest.mark.parametrize("rank", [8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_products_equal_the_per_adapter_reference(rank, dtype):
    gen = torch.Generator().manual_seed(rank)
    rows, k, slots = 37, 96, 4  # slot 0: the base model
    sizes = [64, 32, 32]  # a fused q, k, v
    slot_of = torch.tensor([0] * 5 + [1] * 30 + [3] * 2)[
        torch.randperm(rows, generator=gen)
    ]  # slot 2: no rows
    x = torch.randn(rows, k, generator=gen).to(dtype)
    lora_a = torch.randn(len(sizes), slots, rank, k, generator=gen).to(dtype) * 0.1
    lora_a[:, 0] = 0
    lora_b = [torch.randn(slots, size, rank, generator=gen).to(dtype) * 0.1 for size in sizes]
    lora_b[1][1, :, rank // 2 :] = 0  # a lower rank, zero-padded
    offsets = [(sum(sizes[:p]), size) for p, size in enumerate(sizes)]
    base = torch.randn(rows, sum(sizes), generator=gen).to(dtype)

    expected = base.clone()
    groups = [(s, torch.nonzero(slot_of == s).flatten()) for s in (1, 2, 3) if (slot_of == s).any()]
    add_lora(expected, x, lora_a, lora_b, offsets, groups)
    got = base.clone()
    onehot = torch.nn.functional.one_hot(slot_of, slots).to(dtype)
    onehot[:, 0] = 0
    mask = onehot.repeat_interleave(rank, dim=1)
    add_lora_masked(got, x, lora_a.reshape(-1, k), block_diagonal_b(lora_b), mask)

    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    assert torch.equal(got[slot_of == 0], base[slot_of == 0])  # the base model's rows are untouched
    assert not torch.allclose(got[slot_of == 1], base[slot_of == 1])
