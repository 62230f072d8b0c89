"""The Triton paged-attention kernel against the torch reference.

Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (fp32, tight tolerance);
with one it runs natively, and the ``gpu`` tests add bf16/fp16 at bf16 tolerance.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

pytest.importorskip("triton")

from aioengine.kernels.metadata import AttentionMetadata  # noqa: E402
from aioengine.kernels.reference import paged_attention, paged_attention_reference, store_kv  # noqa: E402
from aioengine.kernels.triton.attention import (  # noqa: E402
    _paged_attention_kernel,
    choose_block_m,
    paged_attention_triton,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NUM_KV_HEADS = 2

# (query_len, seq_len) per request, decodes first.
BATCHES = {
    # decodes, whole prompts, chunks starting mid-sequence (prefix hits), a 1-token chunk at the end
    "mixed": [(1, 1), (1, 7), (1, 37), (5, 5), (4, 13), (18, 18), (3, 20), (1, 6)],
    "decodes": [(1, 33), (1, 2), (1, 16), (1, 17)],
    "prefills": [(21, 40), (6, 6), (2, 2)],
}


def test_interpreter_is_on_without_a_gpu():
    if not CUDA:
        assert type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _setup(batch, block_size, group, head_dim, dtype=torch.float32, device=DEVICE, seed=0):
    """Query rows of the step, and a paged cache (blocks shuffled) holding every request's K/V."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    blocks_per_req = [-(-s // block_size) for _, s in batch]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.full((len(batch), max(blocks_per_req) + 1), perm[-1], dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor(perm[cursor : cursor + n])
        cursor += n
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    total = sum(s for _, s in batch)
    keys = torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen)
    values = torch.randn(total, NUM_KV_HEADS, head_dim, generator=gen)
    everything = AttentionMetadata.build(
        [s for _, s in batch], [s for _, s in batch], block_table, block_size
    )
    store_kv(keys, values, kv_cache, everything.slot_mapping)
    meta = AttentionMetadata.build([q for q, _ in batch], [s for _, s in batch], block_table, block_size)
    query = torch.randn(meta.num_actual_tokens, num_heads, head_dim, generator=gen)
    return query.to(device, dtype), kv_cache.to(device, dtype), _to(meta, device)


def _to(meta, device):
    for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).to(device))
    return meta


def _reference(query, kv_cache, meta, scale):
    cpu = _to(AttentionMetadata(**{f: getattr(meta, f) for f in meta.__slots__}), "cpu")
    return paged_attention_reference(query.cpu().float(), kv_cache.cpu().float(), cpu, scale)


@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_reference(batch, block_size, group, head_dim):
    query, kv_cache, meta = _setup(BATCHES[batch], block_size, group, head_dim)
    scale = head_dim**-0.5
    out = paged_attention_triton(query, kv_cache, meta, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.cpu(), _reference(query, kv_cache, meta, scale), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 6, 19])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_sliding_window_matches_reference_and_skips_blocks_before_it(batch, block_size, window):
    """Decodes and chunks see only their last ``window`` positions; blocks wholly before a request's
    first window hold NaN here (as a freed block may) and must not leak in."""
    query, kv_cache, meta = _setup(BATCHES[batch], block_size, 2, 24, seed=3)
    scale = 24**-0.5
    cpu = _to(AttentionMetadata(**{f: getattr(meta, f) for f in meta.__slots__}), "cpu")
    want = paged_attention_reference(query.cpu(), kv_cache.cpu(), cpu, scale, window=window)
    for i, (q_len, seq_len) in enumerate(BATCHES[batch]):
        for b in range(max(0, seq_len - q_len - window + 1) // block_size):
            kv_cache[:, int(cpu.block_table[i, b])] = float("nan")
    out = paged_attention_triton(query, kv_cache, meta, scale, window=window, block_m=16, tile=16)
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("tile", [16, 64])
def test_tile_shapes_and_odd_group(block_m, tile):
    """Non-power-of-two GQA group (3: 15 of 16 rows used), several q blocks per request, tiles
    smaller and larger than the cache block."""
    query, kv_cache, meta = _setup(BATCHES["mixed"], 16, 3, 24, seed=1)
    out = paged_attention_triton(query, kv_cache, meta, 0.3, block_m=block_m, tile=tile)
    torch.testing.assert_close(out.cpu(), _reference(query, kv_cache, meta, 0.3), atol=2e-5, rtol=0)


def test_dispatch_agrees_with_the_torch_path():
    """``attention.paged_attention`` takes the kernel for CUDA tensors; on CPU the torch path."""
    query, kv_cache, meta = _setup(BATCHES["mixed"], 4, 2, 24, seed=2)
    triton_out = paged_attention_triton(query, kv_cache, meta, 0.25)
    cpu = _to(meta, "cpu")
    torch_out = paged_attention(query.cpu(), kv_cache.cpu(), cpu, 0.25)
    torch.testing.assert_close(triton_out.cpu(), torch_out, atol=2e-5, rtol=0)


def test_padded_rows_zero_and_strided_query():
    """CUDA-graph padding: rows past num_actual_tokens come back zero; a query that is a view of a
    fused qkv (token stride > heads * head_dim) is read in place."""
    query, kv_cache, meta = _setup([(1, 9), (1, 3), (4, 10)], 4, 2, 24, seed=3)
    t, h, d = query.shape
    qkv = torch.randn(t + 3, h * d + 2 * NUM_KV_HEADS * d, device=DEVICE)
    qkv[:t, : h * d] = query.reshape(t, h * d)
    strided = qkv[:, : h * d].view(t + 3, h, d)
    out = paged_attention_triton(strided, kv_cache, meta, 0.3)
    assert torch.count_nonzero(out[t:]) == 0
    torch.testing.assert_close(out[:t].cpu(), _reference(query, kv_cache, meta, 0.3), atol=2e-5, rtol=0)


def test_padded_requests_with_empty_queries():
    """A batch padded with zero-length requests (repeated query_start_loc) launches and ignores them."""
    batch = [(1, 5), (3, 8)]
    query, kv_cache, meta = _setup(batch, 4, 2, 24, seed=4)
    expected = _reference(query, kv_cache, meta, 0.3)
    meta.query_start_loc = torch.cat([meta.query_start_loc, meta.query_start_loc[-1:].repeat(2)])
    meta.seq_lens = torch.cat([meta.seq_lens, torch.ones(2, dtype=torch.int32, device=DEVICE)])
    meta.block_table = torch.cat([meta.block_table, meta.block_table[:2]])
    out = paged_attention_triton(query, kv_cache, meta, 0.3)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    query, kv_cache, meta = _setup(BATCHES["mixed"], 16, 2, 24, dtype=dtype, seed=5)
    out = paged_attention_triton(query, kv_cache, meta, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.cpu().float(), _reference(query, kv_cache, meta, 0.3), atol=2e-2, rtol=2e-2
    )


def test_choose_block_m():
    assert choose_block_m(4, 1) == 16 and choose_block_m(32, 1) == 32
    assert choose_block_m(4, 100) == 64 and choose_block_m(128, 5) == 128


# ---------------------------------------------------------------- native, on a GPU


def _gpu_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    decodes = [(1, int(s)) for s in torch.randint(1, 3000, (48,), generator=gen)]
    chunks = [(int(q), int(q) + int(c)) for q, c in torch.randint(1, 700, (6, 2), generator=gen)]
    return decodes + chunks + [(900, 900), (1, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(4, 128, 16), (3, 64, 16), (2, 24, 32), (8, 64, 4)]
)
def test_gpu_matches_reference_at_low_precision(dtype, group, head_dim, block_size):
    query, kv_cache, meta = _setup(_gpu_batch(group), block_size, group, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_attention_triton(query, kv_cache, meta, scale)
    # The dense fp32 torch path on the GPU's inputs (the per-token reference is too slow here).
    cpu = _to(AttentionMetadata(**{f: getattr(meta, f) for f in meta.__slots__}), "cpu")
    expected = paged_attention(query.cpu().float(), kv_cache.cpu().float(), cpu, scale)
    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_launch_captures_in_a_cuda_graph():
    query, kv_cache, meta = _setup([(1, s) for s in (5, 70, 300, 2)], 16, 4, 64, dtype=torch.bfloat16)
    expected = paged_attention_triton(query, kv_cache, meta, 0.1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(query, kv_cache, meta, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
