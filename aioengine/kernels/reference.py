"""The torch ops: what every backend's kernels must equal, and the path that runs where no kernel applies.

One reference for each op the layers call (RMSNorm, rotary, SiluAndMul, the KV store, paged attention):
the CPU backend falls back to these, and the C and Triton kernels are tested against them.

KV cache layout (vLLM's): ``kv_cache[layer]`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
index 0 holds keys, 1 values. A token's slot is ``block_id * block_size + offset``. On the CPU the same
shape is a view of head-major memory (``[2, num_blocks, num_kv_heads, block_size, head_size]``); every
function here takes either.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from aioengine.kernels.metadata import AttentionMetadata

# enable_gqa appeared in torch 2.5; older torch gets explicit repeats on the prefill path.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


_SINK_SCORES = 1 << 26  # scores (entries) one slice of the sinks path computes at once: 256 MB in float32


def _attend(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """SDPA of ``q [..., Hq, L, D]`` on ``key``/``value [..., Hkv, S, D]`` (``mask``: True where a query
    sees a key). ``sinks`` (gpt-oss; broadcast to the scores' ``[..., Hq, L, 1]``): a learned logit per
    query head that joins each softmax's denominator and adds no value, computed in transformers' eager
    order (scores, the sink column, max subtracted, softmax, the column dropped)."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, key, value, attn_mask=mask, is_causal=is_causal, scale=scale, **kwargs
        )
    if q.shape[-3] != key.shape[-3]:
        rep = q.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    if is_causal:
        mask = torch.ones(q.shape[-2], key.shape[-2], dtype=torch.bool, device=q.device).tril()
    rows = q.shape[-2]
    # a long chunk's score matrix, and its copies, one slice of query rows at a time
    step = max(1, _SINK_SCORES // max(1, q[..., :1, :1].numel() * key.shape[-2]))
    out = []
    for r0 in range(0, rows, step):
        m = mask
        if m is not None and m.shape[-2] == rows:
            m = m[..., r0 : r0 + step, :]
        sk = sinks[..., r0 : r0 + step, :] if sinks.shape[-2] == rows and rows > 1 else sinks
        scores = torch.matmul(q[..., r0 : r0 + step, :], key.transpose(-1, -2)) * scale
        if m is not None:
            scores = scores.masked_fill(~m, float("-inf"))
        combined = torch.cat([scores, sk.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        out.append(torch.matmul(probs.to(value.dtype), value))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order: normalise in fp32, cast back, then scale (so bf16 outputs match HF bit for bit)."""
    # torch's fused rms_norm on the fp32 copy: the same bits as x * rsqrt(mean(x^2) + eps), fewer ops.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)`` like vLLM's fused op."""
    if residual is None:
        return rms_norm(x, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's norm, ``norm(x) * (1 + weight)`` all in fp32 then cast (HF's order); with ``residual`` as
    add_rms_norm."""
    if residual is not None:
        residual = x + residual
        x = residual
    out = (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, residual)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :d]) * x[..., d:]``: GeGLU (Gemma's MLP). The gate is made contiguous: torch's
    tanh-gelu on a strided view takes a scalar loop whose bits differ from the vectorized one HF's separate
    gate_proj output gets."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d].contiguous(), approximate="tanh") * x[..., d:]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate_up projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotation of query ``[T, Hq, D]`` / key ``[T, Hkv, D]`` by ``positions`` from a
    ``[max_position, D]`` cache holding ``cos | sin`` (HF's rotate_half, in its roundings)."""
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(query), rotate(key)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value ``[T, Hkv, D]`` into the cache slots named by ``slot_mapping`` ``[T]``."""
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] != num_tokens:  # padded past num_tokens
        key, value = key[:num_tokens], value[:num_tokens]
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)  # -1: a padded row, as the kernels skip it
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    views = _views(kv_cache)
    if views.key_slots is not None:
        assert views.value_slots is not None  # made with key_slots
        views.key_slots.index_copy_(0, slot_mapping, key)
        views.value_slots.index_copy_(0, slot_mapping, value)
    else:  # a head-major cache (the CPU's layout): slots are not one flat dimension
        block_size = kv_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        views.key_blocks[blocks, offsets] = key
        views.value_blocks[blocks, offsets] = value


def store_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Token by token: the dumbest correct store (tests only). Negative slots are skipped."""
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        kv_cache[0, slot // block_size, slot % block_size] = key[t]
        kv_cache[1, slot // block_size, slot % block_size] = value[t]


@dataclass(slots=True)
class _CacheViews:
    key_blocks: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_blocks: torch.Tensor
    key_slots: torch.Tensor | None  # [num_blocks * block_size, Hkv, D]; None when the layout has no such view
    value_slots: torch.Tensor | None


def _views(kv_cache: torch.Tensor) -> _CacheViews:
    """The views of one layer's cache, made once and kept on the tensor (they live and die with it):
    on CPU each view op costs as much as a small gather."""
    views = getattr(kv_cache, "_aioengine_views", None)
    if views is None:
        k, v = kv_cache.unbind(0)
        h, d = kv_cache.shape[-2], kv_cache.shape[-1]
        flat = k.is_contiguous()  # token-major; the CPU's head-major cache is a transposed view
        views = cast(Any, kv_cache)._aioengine_views = _CacheViews(
            k, v, k.view(-1, h, d) if flat else None, v.view(-1, h, d) if flat else None
        )
    return views


class _Workspace(threading.local):
    """Per-thread scratch for gathered K/V.

    Fresh multi-MB tensors come from mmap and page-fault on every touch; on CPU that cost
    several times the gather itself, so the gather reuses one buffer that only grows.
    """

    buffer: torch.Tensor | None = None

    def get(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffer
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            # A normal tensor (even when first made under inference_mode) stays writable in any mode.
            with torch.inference_mode(False):
                buf = self.buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


_workspace = _Workspace()


def _gather_kv(
    kv_cache: torch.Tensor, flat_ids: torch.Tensor, lead: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather whole blocks ``flat_ids`` -> key, value ``[*lead, nb * block_size, Hkv, D]``.

    The results are views of the thread's workspace, valid until the next gather.
    """
    views = _views(kv_cache)
    key, value = _gather_buffers(views, flat_ids.shape[0])
    # index_select on the flat id list is several times faster on CPU than advanced indexing.
    torch.index_select(views.key_blocks, 0, flat_ids, out=key)
    torch.index_select(views.value_blocks, 0, flat_ids, out=value)
    shape = (*lead, -1, *views.key_blocks.shape[2:])
    return key.view(shape), value.view(shape)


def _gather_buffers(views: _CacheViews, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspace views ``[n, block_size, Hkv, D]`` for the keys and the values of ``n`` blocks."""
    block_shape = views.key_blocks.shape[1:]
    block_numel = block_shape.numel()
    buf = _workspace.get(2 * n * block_numel, views.key_blocks)
    return buf[: n * block_numel].view(n, *block_shape), buf[n * block_numel :].view(n, *block_shape)


@dataclass(slots=True)
class _DecodeGroup:
    indices: torch.Tensor | None  # int64 request rows in this group; None = all decodes in order
    max_seq_len: int
    # Built by the first layer of a step, reused by the others:
    block_ids: torch.Tensor | None = None  # [B * blocks] the blocks to gather, request by request
    mask: torch.Tensor | None = None  # [B, 1, 1, S] padding mask
    key: torch.Tensor | None = None  # [B * blocks, block_size, Hkv, D] gathered keys (a workspace view)
    value: torch.Tensor | None = None


# A decode group's padded gather stays under this many tokens (bounds the workspace).
_MAX_GROUP_TOKENS = 32768
# Groups smaller than this are never split for padding (the extra SDPA call costs more).
_MIN_SPLIT_TOKENS = 2048


def plan_decode_groups(
    seq_lens: list[int],
    device: torch.device,
    min_split_tokens: int = _MIN_SPLIT_TOKENS,
    max_group_tokens: int = _MAX_GROUP_TOKENS,
) -> list[_DecodeGroup]:
    """Split decodes into groups of similar length so the padded gather wastes little."""
    if len(seq_lens) * max(seq_lens) <= min_split_tokens:
        return [_DecodeGroup(None, max(seq_lens))]
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = [[]]
    useful = 0  # real tokens in the open group
    for i in order:
        group = groups[-1]
        padded = (len(group) + 1) * seq_lens[i]  # sorted: the newcomer is the longest
        useful += seq_lens[i]
        if group and (padded > max_group_tokens or (padded > min_split_tokens and padded > 2 * useful)):
            groups.append([i])
            useful = seq_lens[i]
        else:
            group.append(i)
    if len(groups) == 1:
        return [_DecodeGroup(None, max(seq_lens))]
    return [_DecodeGroup(torch.tensor(g, dtype=torch.int64, device=device), seq_lens[g[-1]]) for g in groups]


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    group: _DecodeGroup,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One masked SDPA over a group of decodes: query ``[B, Hq, D]`` -> ``[B, Hq, D]``."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    b, hq, d = query.shape
    if group.mask is None:
        nd = meta.num_decodes
        num_blocks = -(-group.max_seq_len // block_size)
        table, seq_lens = meta.block_table[:nd, :num_blocks], meta.seq_lens[:nd]
        if group.indices is not None:
            table, seq_lens = table.index_select(0, group.indices), seq_lens.index_select(0, group.indices)
        group.block_ids = table.reshape(-1)
        positions = torch.arange(num_blocks * block_size, device=query.device)
        group.mask = (positions < seq_lens[:, None])[:, None, None, :]
    views = _views(kv_cache)
    assert group.block_ids is not None  # planned with the mask
    if group.key is None or group.key.dtype != kv_cache.dtype:
        # Workspace views for every layer: each layer gathers into them before it reads them (a prefill
        # gathering in between may move the workspace; these views then keep the old buffer alive).
        group.key, group.value = _gather_buffers(views, group.block_ids.shape[0])
    assert group.value is not None  # gathered with the key
    torch.index_select(views.key_blocks, 0, group.block_ids, out=group.key)
    torch.index_select(views.value_blocks, 0, group.block_ids, out=group.value)
    key, value = (
        group.key.view(b, -1, num_kv_heads, d),
        group.value.view(b, -1, num_kv_heads, d),
    )  # [B, S, Hkv, D]
    # One query token per request: fold the query heads of a KV group into SDPA's length axis,
    # so GQA costs no repeat of K/V and every row of a request shares one padding mask.
    q = query.reshape(b, num_kv_heads, hq // num_kv_heads, d)
    sinks = None if sinks is None else sinks.view(num_kv_heads, hq // num_kv_heads, 1)
    out = _attend(q, key.transpose(1, 2), value.transpose(1, 2), group.mask, scale, sinks)
    return out.reshape(b, hq, d)


def _decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for the first ``num_decodes`` requests, whose query rows are ``query[:num_decodes]``."""
    nd = meta.num_decodes
    if meta.decode_groups is None:  # planned by the first layer, reused by the rest
        meta.decode_groups = plan_decode_groups(meta.seq_lens_cpu[:nd], query.device)
    if query.shape[0] != nd:
        query = query[:nd]
    groups = meta.decode_groups
    if len(groups) == 1:
        return _decode_attention(query, kv_cache, meta, groups[0], scale, sinks)
    output = torch.empty_like(query)
    for g in groups:
        assert g.indices is not None  # several groups: each names its requests
        output.index_copy_(
            0, g.indices, _decode_attention(query.index_select(0, g.indices), kv_cache, meta, g, scale, sinks)
        )
    return output


def _prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's chunk: query ``[q_len, Hq, D]`` ending at position ``seq_len - 1``. ``window``: each
    token sees only itself and the ``window - 1`` positions before it (blocks before those are not read)."""
    q_len, num_heads, _ = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    context_len = seq_len - q_len
    first_block = 0
    if window is not None and seq_len > window:
        first_block = max(0, context_len - window + 1) // block_size
    else:
        window = None
    key, value = _gather_kv(kv_cache, block_ids[first_block : -(-seq_len // block_size)].reshape(-1))
    base = first_block * block_size  # position of the first gathered slot
    # 4-D [1, H, L, D] inputs: torch's CPU flash kernel takes only those (3-D falls back to the
    # math path, which materialises the whole score matrix).
    key = key[None, : seq_len - base].transpose(1, 2)  # [1, Hkv, S, D]
    value = value[None, : seq_len - base].transpose(1, 2)
    mask = None
    if context_len > 0 or window is not None:
        # Bottom-right aligned causal mask (SDPA's is_causal is top-left aligned), cut to the window.
        positions = torch.arange(context_len, seq_len, device=query.device)[:, None]
        keys = torch.arange(base, seq_len, device=query.device)[None, :]
        mask = keys <= positions
        if window is not None:
            mask &= keys > positions - window
    kwargs = {}
    if num_heads != num_kv_heads:
        if _HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(num_heads // num_kv_heads, 1)
            value = value.repeat_interleave(num_heads // num_kv_heads, 1)
    if sinks is not None:
        sinks = sinks.view(num_heads, 1, 1)
    out = _attend(
        query[None].transpose(1, 2), key, value, mask, scale, sinks, is_causal=mask is None, **kwargs
    )
    return out[0].transpose(0, 1)  # [q_len, Hq, D]


def _windowed_decodes(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decodes that see only their last ``window`` positions: each gathers just the blocks those span
    (at most ``window / block_size + 1``), so the cost is bounded by the window, not the context."""
    nd = meta.num_decodes
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    b, hq, d = nd, query.shape[1], query.shape[2]
    plans = meta.window_plans if meta.window_plans is not None else {}
    meta.window_plans = plans
    plan = plans.get(window)
    if plan is None:  # planned by the first windowed layer of a step, reused by the others
        seq_lens = meta.seq_lens[:nd].long()
        first = (seq_lens - window).clamp(min=0) // block_size
        last = (seq_lens - 1) // block_size
        nb = int((last - first).max()) + 1
        cols = (first[:, None] + torch.arange(nb, device=query.device)).clamp(
            max=meta.block_table.shape[1] - 1
        )
        block_ids = meta.block_table[:nd].long().gather(1, cols).reshape(-1)
        pos = first[:, None] * block_size + torch.arange(nb * block_size, device=query.device)
        mask = ((pos < seq_lens[:, None]) & (pos >= seq_lens[:, None] - window))[:, None, None, :]
        plan = plans[window] = (block_ids, mask)
    block_ids, mask = plan
    views = _views(kv_cache)
    key, value = _gather_buffers(views, block_ids.shape[0])
    torch.index_select(views.key_blocks, 0, block_ids, out=key)
    torch.index_select(views.value_blocks, 0, block_ids, out=value)
    key, value = key.view(b, -1, num_kv_heads, d), value.view(b, -1, num_kv_heads, d)
    q = query[:nd].reshape(b, num_kv_heads, hq // num_kv_heads, d)
    sinks = None if sinks is None else sinks.view(num_kv_heads, hq // num_kv_heads, 1)
    out = _attend(q, key.transpose(1, 2), value.transpose(1, 2), mask, scale, sinks)
    return out.reshape(b, hq, d)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decodes: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query ``[T, Hq, D]`` against the paged cache; returns ``[T, Hq, D]``.

    Rows past ``num_actual_tokens`` (padding) come back zero. ``decodes`` replaces the SDPA path for the
    leading decode rows (a backend's kernel: ``decodes(query, kv_cache, meta, scale)``, which applies the
    window itself when one is given). ``window``
    (sliding-window layers): a token attends to itself and the ``window - 1`` positions before it; while
    no sequence is longer than the window that is full attention, and takes the same paths. ``sinks``
    (``[Hq]``, gpt-oss): each head's sink logit in every softmax (see ``_attend``); no backend kernel then.
    """
    assert query.shape[1] % kv_cache.shape[-2] == 0, "query heads must be a multiple of KV heads"
    num_decodes = meta.num_decodes
    assert sinks is None or decodes is None, "the decode kernels take no sinks"
    if window is not None and meta.max_seq_len > window:
        decodes = decodes or functools.partial(_windowed_decodes, window=window, sinks=sinks)
    else:
        window = None
        decodes = decodes or functools.partial(_decodes, sinks=sinks)
    if meta.num_reqs == num_decodes and query.shape[0] == num_decodes:
        return decodes(query, kv_cache, meta, scale)  # pure decode: no extra copy
    output = torch.zeros_like(query) if query.shape[0] > meta.num_actual_tokens else torch.empty_like(query)
    if num_decodes > 0:
        output[:num_decodes] = decodes(query, kv_cache, meta, scale)
    starts = meta.query_start_loc_cpu
    for i in range(num_decodes, meta.num_reqs):
        start, end = starts[i], starts[i + 1]
        output[start:end] = _prefill_attention(
            query[start:end], kv_cache, meta.block_table[i], meta.seq_lens_cpu[i], scale, window, sinks
        )
    return output


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dumbest correct version: per request, per token, slot by slot, in float64. Tests only."""
    _, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    output = torch.zeros_like(query)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        for j in range(end - start):
            position = seq_len - (end - start) + j
            lo = 0 if window is None else max(0, position - window + 1)
            keys = torch.empty(position + 1 - lo, num_kv_heads, head_size, dtype=torch.float64)
            values = torch.empty_like(keys)
            for p in range(lo, position + 1):
                block_id = int(meta.block_table[i, p // block_size])
                keys[p - lo] = kv_cache[0, block_id, p % block_size]
                values[p - lo] = kv_cache[1, block_id, p % block_size]
            for h in range(num_heads):
                q = query[start + j, h].double()
                scores = (keys[:, h // group] @ q) * scale
                if sinks is not None:  # the sink's share of the denominator carries no value
                    scores = torch.cat([scores, sinks[h].double().view(1)])
                probs = torch.softmax(scores, dim=0)[: len(keys)]
                output[start + j, h] = (probs @ values[:, h // group]).to(query.dtype)
    return output
