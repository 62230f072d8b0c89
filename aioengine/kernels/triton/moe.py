"""The routed experts' MLP as Triton grouped GEMMs over the token-expert pairs sorted by expert, as vLLM's
``fused_moe`` runs it (reference: ``reference_moe.fused_moe_by_expert``).

The pairs are counting-sorted by expert and each expert's run padded to a whole block of rows, so every
program's tile of rows belongs to one expert and reads only that expert's weights: an expert no token chose
gets no block. Gate_up, then SwiGLU, then down, then each token's weighted sum over its k pairs. The sort runs
on the device without a host sync (the padded length is bounded by P + E (BLOCK_M - 1)). Importing this module
imports triton; only the CUDA backend and the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioengine.kernels.triton.activation import silu_and_mul_triton
from aioengine.kernels.triton.utils import cast_to, interpreted

BLOCK_M = 16  # rows of a tile: the smallest tl.dot, and a decode's few tokens per expert waste little
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    a_ptr,
    w_ptr,
    c_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_pairs,
    a_div,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_M: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """c[pair, n] = a[pair // a_div] . w[expert, n] for one expert's tile of pairs (padding: num_pairs)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pairs = tl.load(pairs_ptr + pid_m * TILE_M + tl.arange(0, TILE_M))
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // a_div, 0).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((TILE_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0
        )
        w = tl.load(
            w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    out = cast_to(acc, c_ptr.dtype.element_ty, INTERPRET)
    tl.store(
        c_ptr + pairs[:, None].to(tl.int64) * stride_c + cols[None, :],
        out,
        mask=valid[:, None] & (cols[None, :] < N),
    )


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair indices [padded], the expert of each BLOCK_M-row tile): the pairs of ``topk_ids.flatten()``
    grouped by expert in token order, each expert's run padded with ``P`` (no pair) to whole tiles; tiles past
    the last run (the bound's slack) hold padding only."""
    flat = topk_ids.flatten()
    p = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = torch.cumsum(padded, 0) - padded  # each expert's first slot in the padded layout
    firsts = torch.cumsum(counts, 0) - counts  # and in the plain sorted order
    experts = flat[order]
    slots = starts[experts] + torch.arange(p, device=flat.device) - firsts[experts]
    length = p + num_experts * (BLOCK_M - 1)
    length = (length + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pairs = torch.full((length,), p, dtype=torch.int64, device=flat.device)
    pairs[slots] = order
    ends = torch.cumsum(padded, 0)
    tiles = torch.arange(0, length, BLOCK_M, device=flat.device)
    block_expert = torch.searchsorted(ends, tiles, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    pairs: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    a_div: int,
) -> torch.Tensor:
    """``[num_pairs, N]``: row ``pair`` is ``a[pair // a_div] @ w[its expert].T`` (``w`` ``[E, N, K]``)."""
    n, k = w.shape[1], w.shape[2]
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and a.shape[-1] == k
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    interpret = interpreted(_grouped_gemm_kernel)
    # fp32 models get exact fp32 dots (no TF32); the interpreter's tl.dot takes no bf16 (bf16 products are
    # exact in fp32, so fp32 operands give the same sums)
    dot_dtype = tl.float32 if a.dtype == torch.float32 or interpret else _TL_DTYPES[a.dtype]
    precision = "ieee" if dot_dtype == tl.float32 else "tf32"
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    grid = (pairs.numel() // BLOCK_M, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, pairs, block_expert, num_pairs, a_div, n, k, a.stride(0), w.stride(0), w.stride(1),
        c.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, TILE_M=BLOCK_M, DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision, INTERPRET=interpret,
    )  # fmt: skip
    return c


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``reference_moe.fused_moe``'s contract: ``x [T, H]``, stacked ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``;
    each token's sum over its k experts of weight * down(silu(gate x) * up x). The k terms are summed in pair
    order, not in increasing expert order as the reference adds them (float roundings apart, the same)."""
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    pairs, block_expert = sort_pairs(topk_ids, w13.shape[0])
    gate_up = _grouped_gemm(x, w13, pairs, block_expert, t * k, k)
    act = silu_and_mul_triton(gate_up)
    down = _grouped_gemm(act, w2, pairs, block_expert, t * k, 1)
    weighted = down.view(t, k, -1).float() * topk_weights.view(t, k, 1).float()
    return weighted.sum(1).to(x.dtype)
