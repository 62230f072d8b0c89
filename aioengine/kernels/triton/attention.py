"""Paged attention for a mixed flat batch in one Triton varlen kernel.

One program handles ``BLOCK_Q`` query tokens of one request times all ``GROUP`` query heads that
share one KV head (GQA packs them into the ``BLOCK_M = BLOCK_Q * GROUP`` rows of a tile), and walks
the request's KV positions ``0..last query position`` in tiles of ``TILE`` positions, gathered
through the block table (so ``TILE`` is independent of the cache's block size), with an online
softmax accumulated in fp32. Query token ``j`` of request ``i`` sits at position
``seq_lens[i] - q_len_i + j`` and sees cache positions up to its own (a sliding-window layer: only the
``window`` last of them): decodes, prefill chunks that start mid-sequence (prefix hits, chunked prefill)
and whole prompts are one case.

The grid depends only on shapes (``num_tokens // BLOCK_Q + num_reqs`` programs per KV head; each
finds its request by a binary search over ``query_start_loc``), so a launch can be captured in a
CUDA graph. The torch reference is ``reference.paged_attention_reference``.

Importing this module imports triton; only the CUDA backend does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from aioengine.kernels.metadata import AttentionMetadata
from aioengine.kernels.triton.utils import cast_to, interpreted


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    """The request ``i`` whose q blocks start at ``query_start_loc[i] // BLOCK_Q + i <= q_block``
    (largest such ``i``). The starts grow by at least ``cdiv(q_len, BLOCK_Q)`` per request."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    window,  # a sliding-window layer's span (itself and window - 1 before); 0: full attention
    num_reqs,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:  # spare program (the grid is an upper bound)
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block_local * BLOCK_Q + rows // GROUP  # token index inside the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_tok < q_len)
    q_pos = context_len + q_tok  # absolute position: attends to cache positions 0..q_pos
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    tok = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)

    # Positions this program needs: up to its last valid query's position, from its first query's
    # window on (blocks before that are never read: a windowed cache may have freed them).
    kv_len = tl.minimum(context_len + (q_block_local + 1) * BLOCK_Q, seq_len)
    kv_lo = 0
    if window > 0:
        kv_lo = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_lo - kv_lo % TILE, kv_len, TILE):
        pos = start + tl.arange(0, TILE)
        pos_ok = (pos < kv_len) & (pos >= kv_lo)
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
        k = tl.load(  # [HEAD_DIM_P, TILE]: K transposed for the dot
            key_cache_ptr + kv_off[None, :] + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        ).to(DOT_DTYPE)
        v = tl.load(
            value_cache_ptr + kv_off[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        p_dtype = v.dtype  # probabilities round to the cache dtype before the PV dot
        v = v.to(DOT_DTYPE)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = row_ok[:, None] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with nothing visible yet
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            cast_to(p, p_dtype, INTERPRET).to(DOT_DTYPE), v, input_precision=DOT_PRECISION
        )
        m_i = m_new

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
        cast_to(out, out_ptr.dtype.element_ty, INTERPRET),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def choose_block_m(group: int, max_query_len: int) -> int:
    """Rows of a program's tile: at least 16 (the smallest tl.dot), all of a KV head's query heads;
    64 when there are prefill chunks, so a chunk's K/V is read once per more query tokens."""
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len > 1:
        block_m = max(block_m, 64)
    return block_m


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    block_m: int | None = None,
    tile: int = 32,
) -> torch.Tensor:
    """Causal attention of query ``[T, Hq, D]`` against the paged cache; returns ``[T, Hq, D]``.
    ``window``: a sliding-window layer's span, as ``reference.paged_attention``'s.

    Same contract as ``reference.paged_attention``: rows past ``num_actual_tokens`` come back zero.
    Uses ``meta.query_start_loc``, ``seq_lens`` and ``block_table`` (device tensors) and the host
    ints ``num_actual_tokens`` / ``max_query_len``; nothing is copied from the device.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim, (query.shape, kv_cache.shape)
    assert kv_cache.dtype == query.dtype, "the kernel reads the cache in the activations' dtype"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1
    group = num_heads // num_kv_heads
    if num_tokens > meta.num_actual_tokens:
        output = torch.zeros(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    else:
        output = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    num_reqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return output
    if block_m is None:
        block_m = choose_block_m(group, meta.max_query_len)
    assert block_m >= group and block_m >= 16
    block_q = block_m // group
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    block_table = meta.block_table
    assert block_table.stride(-1) == 1
    # fp32 models get exact fp32 dots (no TF32); bf16/fp16 take the tensor cores as they are.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    dot_dtype = _TL_DTYPES[query.dtype]
    interpret = interpreted(_paged_attention_kernel)
    if query.dtype == torch.bfloat16 and interpret:
        # The CPU interpreter's tl.dot mishandles bf16 operands (numpy has no bf16). A bf16 x bf16
        # product is exact in fp32, so fp32 operands give the same fp32-accumulated dot.
        dot_dtype, precision = tl.float32, "ieee"
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        output,
        query,
        key_cache,
        value_cache,
        block_table,
        meta.seq_lens,
        meta.query_start_loc,
        scale * math.log2(math.e),
        window or 0,
        num_reqs,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=tile,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=precision,
        INTERPRET=interpret,
    )
    return output
