"""Write new K/V into the paged cache by ``slot_mapping``: a Triton kernel.

Its reference is ``reference.store_kv_reference``. The cache layout is ``kv_cache``
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = keys, 1 = values); a token's slot is
``block_id * block_size + offset``. A negative slot (a padded row of a CUDA-graph batch) is skipped by the
kernel.

Importing this module imports triton; only the CUDA backend does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioengine.kernels.triton.utils import cast_to, interpreted


@triton.jit
def _store_kv_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding row
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    token = token.to(tl.int64)
    cache_off = (
        block * stride_c_block + offset * stride_c_off + heads[:, None] * stride_c_head + dims[None, :]
    )
    k = tl.load(key_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_off, cast_to(k, key_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(value_cache_ptr + cache_off, cast_to(v, value_cache_ptr.dtype.element_ty, INTERPRET), mask=mask)


def store_kv_triton(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value ``[T', Hkv, D]`` (``T' >= T``; views of a fused qkv are fine) into the slots
    ``slot_mapping`` ``[T]`` names. Same contract as ``reference.store_kv``, plus: slot < 0 is skipped.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape[1:] == value.shape[1:] == (num_kv_heads, head_dim), (key.shape, kv_cache.shape)
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        INTERPRET=interpreted(_store_kv_kernel),
    )
