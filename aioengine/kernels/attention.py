"""Paged attention over a block-structured KV cache: metadata, KV store and the torch (CPU) path.

Layout (vLLM's): ``kv_cache[layer]`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]``;
index 0 holds keys, 1 values. A token's slot is ``block_id * block_size + offset``. On the CPU the same
shape is a view of head-major memory (``[2, num_blocks, num_kv_heads, block_size, head_size]``,
``gpu/loader.py``); every function here takes either.

The flat batch is sorted decodes first: requests ``0..num_decodes-1`` have exactly one query token.
The j-th query token of request i sits at position ``seq_lens[i] - q_len_i + j`` and attends
causally to cache positions ``0..position`` (its own K/V are stored before attention runs).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aioengine.kernels import cpu_kernels

# The C decode kernel when it builds here (tests turn it off to exercise the torch path).
use_cpu_kernel = True
use_cpu_prefill = True  # bf16 prompt chunks through the packed prefill kernel (cpu_prefill_attention.c)

# enable_gqa appeared in torch 2.5; older torch gets explicit repeats on the prefill path.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(slots=True)
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # the first num_decodes requests are decodes: 1 query token each, past the prompt
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [num_reqs], tokens in the KV cache after this step
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], physical block ids
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], slot of each new token
    query_start_loc_cpu: list[int]  # host copies used by CPU loops
    seq_lens_cpu: list[int]
    # Torch path only: decode grouping planned by the first layer of a step, reused by the others.
    decode_groups: list[_DecodeGroup] | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        block_size: int,
        num_decodes: int | None = None,
    ) -> AttentionMetadata:
        """Metadata from per-request lists (tests and simple callers; the runner builds its own).

        By default the leading run of 1-token queries counts as decodes (a 1-token chunk attends
        exactly like a decode); a 1-token query after it takes the per-request path.
        """
        assert len(query_lens) == len(seq_lens) == block_table.shape[0]
        assert all(0 < q <= s for q, s in zip(query_lens, seq_lens, strict=True))
        if num_decodes is None:
            num_decodes = 0
            while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
                num_decodes += 1
        assert all(q == 1 for q in query_lens[:num_decodes]), "decodes come first, one token each"
        starts = [0]
        slots: list[int] = []
        table = block_table.tolist()
        for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            starts.append(starts[-1] + q_len)
            slots += [
                table[i][p // block_size] * block_size + p % block_size
                for p in range(seq_len - q_len, seq_len)
            ]
        device = block_table.device
        return cls(
            num_reqs=len(query_lens),
            num_decodes=num_decodes,
            num_actual_tokens=starts[-1],
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=block_table.to(torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value ``[T, Hkv, D]`` into the cache slots named by ``slot_mapping`` ``[T]``."""
    if kv_cache.is_cuda:  # Triton kernel (imported lazily: the CPU path never needs triton)
        from aioengine.kernels.kv_store import store_kv_triton

        return store_kv_triton(key, value, kv_cache, slot_mapping)
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] != num_tokens:  # padded past num_tokens
        key, value = key[:num_tokens], value[:num_tokens]
    if use_cpu_kernel and cpu_kernels.store_ok(key, kv_cache):
        cpu_kernels.store_kv(key, value, kv_cache, slot_mapping)
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)  # -1: a padded row, as the kernels skip it
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    views = _views(kv_cache)
    if views.key_slots is not None:
        views.key_slots.index_copy_(0, slot_mapping, key)
        views.value_slots.index_copy_(0, slot_mapping, value)
    else:  # a head-major cache (the CPU's layout): slots are not one flat dimension
        block_size = kv_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        views.key_blocks[blocks, offsets] = key
        views.value_blocks[blocks, offsets] = value


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
        views = kv_cache._aioengine_views = _CacheViews(k, v, k.view(-1, h, d) if flat else None,
                                                        v.view(-1, h, d) if flat else None)
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


def _plan_decode_groups(seq_lens: list[int], device: torch.device) -> list[_DecodeGroup]:
    """Split decodes into groups of similar length so the padded gather wastes little."""
    if len(seq_lens) * max(seq_lens) <= _MIN_SPLIT_TOKENS:
        return [_DecodeGroup(None, max(seq_lens))]
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = [[]]
    useful = 0  # real tokens in the open group
    for i in order:
        group = groups[-1]
        padded = (len(group) + 1) * seq_lens[i]  # sorted: the newcomer is the longest
        useful += seq_lens[i]
        if group and (padded > _MAX_GROUP_TOKENS or (padded > _MIN_SPLIT_TOKENS and padded > 2 * useful)):
            groups.append([i])
            useful = seq_lens[i]
        else:
            group.append(i)
    if len(groups) == 1:
        return [_DecodeGroup(None, max(seq_lens))]
    return [_DecodeGroup(torch.tensor(g, dtype=torch.int64, device=device), seq_lens[g[-1]]) for g in groups]


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, group: _DecodeGroup, scale: float
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
    if group.key is None or group.key.dtype != kv_cache.dtype:
        # Workspace views for every layer: each layer gathers into them before it reads them (a prefill
        # gathering in between may move the workspace; these views then keep the old buffer alive).
        group.key, group.value = _gather_buffers(views, group.block_ids.shape[0])
    torch.index_select(views.key_blocks, 0, group.block_ids, out=group.key)
    torch.index_select(views.value_blocks, 0, group.block_ids, out=group.value)
    key, value = group.key.view(b, -1, num_kv_heads, d), group.value.view(b, -1, num_kv_heads, d)  # [B, S, Hkv, D]
    # One query token per request: fold the query heads of a KV group into SDPA's length axis,
    # so GQA costs no repeat of K/V and every row of a request shares one padding mask.
    q = query.reshape(b, num_kv_heads, hq // num_kv_heads, d)
    out = F.scaled_dot_product_attention(
        q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=group.mask, scale=scale
    )
    return out.reshape(b, hq, d)


def _decodes(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention for the first ``num_decodes`` requests, whose query rows are ``query[:num_decodes]``."""
    nd = meta.num_decodes
    if use_cpu_kernel and cpu_kernels.supports(query, kv_cache) and cpu_kernels.load() is not None:
        # Straight from the blocks: no gather, no padding (cpu_decode_attention.c).
        return cpu_kernels.decode_attention(query[:nd], kv_cache, meta.block_table, meta.seq_lens, scale)
    if meta.decode_groups is None:  # planned by the first layer, reused by the rest
        meta.decode_groups = _plan_decode_groups(meta.seq_lens_cpu[:nd], query.device)
    if query.shape[0] != nd:
        query = query[:nd]
    groups = meta.decode_groups
    if len(groups) == 1:
        return _decode_attention(query, kv_cache, meta, groups[0], scale)
    output = torch.empty_like(query)
    for g in groups:
        output.index_copy_(0, g.indices, _decode_attention(query.index_select(0, g.indices), kv_cache, meta, g, scale))
    return output


def _prefill_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scale: float
) -> torch.Tensor:
    """One request's chunk: query ``[q_len, Hq, D]`` ending at position ``seq_len - 1``."""
    q_len, num_heads, _ = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    key, value = _gather_kv(kv_cache, block_ids[: -(-seq_len // block_size)].reshape(-1))
    # 4-D [1, H, L, D] inputs: torch's CPU flash kernel takes only those (3-D falls back to the
    # math path, which materialises the whole score matrix).
    key = key[None, :seq_len].transpose(1, 2)  # [1, Hkv, S, D]
    value = value[None, :seq_len].transpose(1, 2)
    context_len = seq_len - q_len
    mask = None
    if context_len > 0:
        # Bottom-right aligned causal mask; SDPA's is_causal is top-left aligned.
        positions = torch.arange(context_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
    kwargs = {}
    if num_heads != num_kv_heads:
        if _HAS_ENABLE_GQA:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(num_heads // num_kv_heads, 1)
            value = value.repeat_interleave(num_heads // num_kv_heads, 1)
    out = F.scaled_dot_product_attention(
        query[None].transpose(1, 2), key, value, attn_mask=mask, is_causal=mask is None, scale=scale, **kwargs
    )
    return out[0].transpose(0, 1)  # [q_len, Hq, D]


def _cpu_mixed(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """bf16 on AVX512-BF16 (cpu_kernels.fast_prefill): decodes through the decode kernel, every prompt chunk
    (one token or thousands) through the packed prefill kernel, whose per-row arithmetic ignores how the
    prompt was chunked: a prefix-cache hit gives the same bits as computing the prompt afresh."""
    n, starts, nd = meta.num_actual_tokens, meta.query_start_loc_cpu, meta.num_decodes
    output = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)
    if nd:
        output[:nd] = cpu_kernels.decode_attention(query[:nd], kv_cache, meta.block_table[:nd], meta.seq_lens[:nd],
                                                   scale)
    for i in range(nd, meta.num_reqs):
        output[starts[i]:starts[i + 1]] = cpu_kernels.prefill_attention(
            query[starts[i]:starts[i + 1]], kv_cache, meta.block_table[i], meta.seq_lens_cpu[i], scale)
    return output


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of query ``[T, Hq, D]`` against the paged cache; returns ``[T, Hq, D]``.

    Rows past ``num_actual_tokens`` (padding) come back zero.
    """
    if query.is_cuda:  # one Triton varlen kernel (imported lazily: the CPU path never needs triton)
        from aioengine.kernels.triton_attention import paged_attention_triton

        return paged_attention_triton(query, kv_cache, meta, scale)
    assert query.shape[1] % kv_cache.shape[-2] == 0, "query heads must be a multiple of KV heads"
    num_decodes = meta.num_decodes
    if meta.num_reqs == num_decodes and query.shape[0] == num_decodes:
        return _decodes(query, kv_cache, meta, scale)  # pure decode: no extra copy
    if use_cpu_kernel and use_cpu_prefill and cpu_kernels.fast_prefill(query, kv_cache):
        return _cpu_mixed(query, kv_cache, meta, scale)
    output = torch.zeros_like(query) if query.shape[0] > meta.num_actual_tokens else torch.empty_like(query)
    if num_decodes > 0:
        output[:num_decodes] = _decodes(query, kv_cache, meta, scale)
    starts = meta.query_start_loc_cpu
    for i in range(num_decodes, meta.num_reqs):
        start, end = starts[i], starts[i + 1]
        output[start:end] = _prefill_attention(
            query[start:end], kv_cache, meta.block_table[i], meta.seq_lens_cpu[i], scale
        )
    return output


def paged_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The dumbest correct version: per request, per token, slot by slot. Tests only."""
    _, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    output = torch.zeros_like(query)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        seq_len = meta.seq_lens_cpu[i]
        for j in range(end - start):
            position = seq_len - (end - start) + j
            keys = torch.empty(position + 1, num_kv_heads, head_size, dtype=torch.float64)
            values = torch.empty_like(keys)
            for p in range(position + 1):
                block_id = int(meta.block_table[i, p // block_size])
                keys[p] = kv_cache[0, block_id, p % block_size]
                values[p] = kv_cache[1, block_id, p % block_size]
            for h in range(num_heads):
                q = query[start + j, h].double()
                scores = (keys[:, h // group] @ q) * scale
                probs = torch.softmax(scores, dim=0)
                output[start + j, h] = (probs @ values[:, h // group]).to(query.dtype)
    return output
