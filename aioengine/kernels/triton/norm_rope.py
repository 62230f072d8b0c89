"""RMSNorm (with the fused residual add) and neox RoPE as Triton kernels.

Their references are ``aioengine.kernels.reference.add_rms_norm`` and ``.rotary``; the kernels compute
in fp32 but round every intermediate the torch version rounds
(the residual sum, the normalised activations, each RoPE product), so for bf16/fp16 they agree with
the torch path to the last bit up to reduction order (RMSNorm's variance) and fused multiply-adds.

Importing this module imports triton; only the CUDA backend does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aioengine.kernels.triton.utils import cast_to, interpreted

# ---------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    out_ptr,
    residual_out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    rows_inner,  # rows are (outer, inner) pairs: a [T, H, D] per-head view needs two strides
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_inner
    inner = row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0
        )
        x = cast_to(x.to(tl.float32) + r.to(tl.float32), residual_out_ptr.dtype.element_ty, INTERPRET)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(h * h, axis=0) / n_cols + eps))
    h = cast_to(h * inv_rms, x.dtype, INTERPRET).to(tl.float32)  # HF casts back before scaling by the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, cast_to(w * h, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


def _rows(t: torch.Tensor) -> tuple[int, int, int]:
    """(inner row count, outer stride, inner stride) of a 2-D or 3-D tensor with a unit last stride."""
    assert t.stride(-1) == 1, "the normalised axis must be contiguous"
    if t.dim() == 2:
        return 1, t.stride(0), 0
    assert t.dim() == 3, "rms_norm_triton takes [T, N] or [T, H, N]"
    return t.shape[1], t.stride(0), t.stride(1)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.add_rms_norm``; ``x`` is ``[T, N]`` or ``[T, H, N]`` (a strided
    per-head view of a fused qkv is fine). Outputs are new contiguous tensors."""
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rows_inner, sx_outer, sx_inner = _rows(x)
    num_rows = x.numel() // n_cols
    if residual is not None:
        assert residual.shape == x.shape
        residual_out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
        _, sr_outer, sr_inner = _rows(residual)
    else:
        residual_out, sr_outer, sr_inner = out, 0, 0
    if num_rows > 0:
        _rms_norm_kernel[(num_rows,)](
            out,
            residual_out,
            x,
            x if residual is None else residual,
            weight,
            rows_inner,
            sx_outer,
            sx_inner,
            sr_outer,
            sr_inner,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(n_cols),
            INTERPRET=interpreted(_rms_norm_kernel),
            num_warps=min(max(triton.next_power_of_2(n_cols) // 256, 1), 8),
        )
    return out if residual is None else (out, residual_out)


# ---------------------------------------------------------------- RoPE (neox)


@triton.jit
def _rotate_heads(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    x_ptr,
    out_ptr,
    token,
    stride_tok,
    stride_head,
    stride_out_tok,
    stride_out_head,
    num_heads,
    cos,
    sin,
    dims,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    src = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # torch rounds each product and each sum to the activation dtype: so do we.
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    x1c = cast_to(x1f * c, dtype, INTERPRET).to(tl.float32)
    x2s = cast_to(x2f * s, dtype, INTERPRET).to(tl.float32)
    x2c = cast_to(x2f * c, dtype, INTERPRET).to(tl.float32)
    x1s = cast_to(x1f * s, dtype, INTERPRET).to(tl.float32)
    o1 = cast_to(x1c - x2s, dtype, INTERPRET)
    o2 = cast_to(x2c + x1s, dtype, INTERPRET)
    dst = out_ptr + token * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]  # @triton.jit reads annotations as arg types
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cache_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    Q_HEADS_P: tl.constexpr,
    K_HEADS_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)
    dim_ok = dims < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + dims, mask=dim_ok, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + dims, mask=dim_ok, other=0.0)
    # cos/sin keep their stored values; _rotate_heads rounds each product to the output dtype.
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32)
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_q_tok, stride_q_head, stride_qo_tok, stride_qo_head,
        num_q_heads, cos, sin, dims, HALF, Q_HEADS_P, INTERPRET,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_k_tok, stride_k_head, stride_ko_tok, stride_ko_head,
        num_k_heads, cos, sin, dims, HALF, K_HEADS_P, INTERPRET,
    )  # fmt: skip


def rotary_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.rotary``. ``query``/``key`` may be strided views (of a fused
    qkv); ``inplace=True`` writes the rotation back into them (vLLM's convention) and returns them.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert key.shape == (num_tokens, num_k_heads, head_dim) and head_dim % 2 == 0
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(-1) == 1
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    if inplace:
        assert query.dtype == torch.promote_types(query.dtype, cos_sin_cache.dtype)
        q_out, k_out = query, key
    else:
        q_out = torch.empty(
            query.shape, dtype=torch.promote_types(query.dtype, cos_sin_cache.dtype), device=query.device
        )
        k_out = torch.empty(
            key.shape, dtype=torch.promote_types(key.dtype, cos_sin_cache.dtype), device=key.device
        )
    if num_tokens > 0:
        half = head_dim // 2
        _rope_kernel[(num_tokens,)](
            query,
            key,
            q_out,
            k_out,
            positions,
            cos_sin_cache,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos_sin_cache.stride(0),
            num_q_heads,
            num_k_heads,
            HALF=half,
            HALF_P=triton.next_power_of_2(half),
            Q_HEADS_P=triton.next_power_of_2(num_q_heads),
            K_HEADS_P=triton.next_power_of_2(num_k_heads),
            INTERPRET=interpreted(_rope_kernel),
        )
    return q_out, k_out
