"""The Triton KV-store kernel against the token-by-token torch reference (interpreted on CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported

pytest.importorskip("triton")

from aioengine.kernels.metadata import AttentionMetadata  # noqa: E402
from aioengine.kernels.reference import store_kv, store_kv_reference  # noqa: E402
from aioengine.kernels.triton.kv_store import _store_kv_kernel, store_kv_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_interpreter_is_on_without_a_gpu():
    if not CUDA:
        assert type(_store_kv_kernel).__name__ == "InterpretedFunction"


def _case(block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A step's new K/V as views of a fused qkv (padded past the real tokens) and its slots."""
    gen = torch.Generator().manual_seed(seed)
    batch = [(1, 9), (1, 2), (5, 5), (7, 19), (3, 33)]  # (query_len, seq_len), decodes first
    num_blocks = sum(-(-s // block_size) for _, s in batch) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    rows, cursor = [], 0
    width = max(-(-s // block_size) for _, s in batch)
    for _, s in batch:
        n = -(-s // block_size)
        rows.append(torch.cat([perm[cursor : cursor + n], perm[-1:].repeat(width - n)]))
        cursor += n
    meta = AttentionMetadata.build(
        [q for q, _ in batch], [s for _, s in batch], torch.stack(rows).int(), block_size
    )
    t = meta.num_actual_tokens
    kv = num_kv_heads * head_dim
    qkv = torch.randn(t + 4, 3 * kv, generator=gen).to(DEVICE, dtype)  # 4 padded rows
    key = qkv[:, kv : 2 * kv].view(t + 4, num_kv_heads, head_dim)
    value = qkv[:, 2 * kv :].view(t + 4, num_kv_heads, head_dim)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return key, value, kv_cache, meta.slot_mapping.to(DEVICE)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 24), (2, 64), (3, 24)])
def test_matches_reference(block_size, num_kv_heads, head_dim):
    key, value, kv_cache, slots = _case(block_size, num_kv_heads, head_dim)
    expected = kv_cache.clone()
    store_kv_reference(key, value, expected, slots)
    store_kv_triton(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)  # a copy: exact, untouched slots included
    # The torch CPU path agrees with the reference too.
    cpu = kv_cache.cpu().clone()
    store_kv(key.cpu(), value.cpu(), cpu, slots.cpu())
    assert torch.equal(cpu, expected.cpu())


def test_negative_slots_are_skipped():
    key, value, kv_cache, slots = _case(4, 2, 24, seed=1)
    slots = slots.clone()
    slots[1] = slots[4] = -1  # padded rows of a CUDA-graph batch
    expected = kv_cache.clone()
    store_kv_reference(key, value, expected, slots)
    store_kv_triton(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_exact(dtype):
    key, value, kv_cache, slots = _case(16, 2, 24, dtype=dtype, seed=2)
    expected = kv_cache.clone()
    store_kv_reference(key, value, expected, slots)
    store_kv_triton(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_dispatch_matches_reference():
    key, value, kv_cache, slots = _case(16, 8, 128, dtype=torch.bfloat16, seed=3)
    expected = kv_cache.clone()
    store_kv_reference(key, value, expected, slots)
    from aioengine.gpu.cuda.backend import CudaOps

    CudaOps().store_kv(key, value, kv_cache, slots)  # the CUDA backend's op is the kernel
    assert torch.equal(kv_cache, expected)
