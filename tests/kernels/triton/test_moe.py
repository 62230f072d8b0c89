"""The Triton fused MoE (grouped GEMMs over pairs sorted by expert) against the torch reference, interpreted
on the CPU: top-k 1 to 8, an expert taking every token, idle experts, float32 and bf16; the sort's tiles."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

pytest.importorskip("triton")

from aioengine.kernels.reference_moe import fused_moe, select_experts  # noqa: E402
from aioengine.kernels.triton.moe import BLOCK_M, fused_moe_triton, sort_pairs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, INTER = 8, 64, 48  # an intermediate size that is not a power of two: masked columns


def _case(tokens: int, top_k: int, load: str, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    logits = torch.randn(tokens, E, generator=g)
    if load == "one_takes_all":
        logits[:, 5] += 100
    elif load == "some_idle":
        logits[:, [0, 3, 7]] -= 100
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("load", ["random", "one_takes_all", "some_idle"])
@pytest.mark.parametrize("tokens", [1, 7, 20])
def test_the_triton_fused_moe_equals_the_reference_in_float32(top_k, load, tokens):
    x, w13, w2, weights, ids = _case(tokens, top_k, load, torch.float32, top_k * 100 + tokens)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_the_triton_fused_moe_in_bfloat16_and_with_no_tokens():
    x, w13, w2, weights, ids = _case(9, 2, "random", torch.bfloat16, 3)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fused_moe(x, w13, w2, weights, ids).float(), rtol=2e-2, atol=2e-2)
    empty = fused_moe_triton(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H)


def test_each_tile_holds_one_experts_pairs_in_token_order():
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], device=DEVICE)
    pairs, block_expert = sort_pairs(ids, 5)
    p = ids.numel()
    assert pairs.numel() % BLOCK_M == 0 and pairs.numel() >= p + 5 * (BLOCK_M - 1) - BLOCK_M
    flat = ids.flatten().tolist()
    seen = []
    for tile, expert in enumerate(block_expert.tolist()):
        chunk = [q for q in pairs[tile * BLOCK_M : (tile + 1) * BLOCK_M].tolist() if q < p]
        assert all(flat[q] == expert for q in chunk) and chunk == sorted(chunk)
        seen += chunk
    assert sorted(seen) == list(range(p))  # every pair once; experts 2 and 4 (unchosen) get no tile's pairs
