"""paged_attention against the per-token reference and against dense causal attention."""

import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from aioengine.config import KernelConfig
from aioengine.gpu.cpu.backend import CpuOps
from aioengine.kernels import reference
from aioengine.kernels.metadata import AttentionMetadata
from aioengine.kernels.reference import paged_attention_reference

HEAD_SIZE = 8
NUM_KV_HEADS = 2


OPS = CpuOps()


def paged_attention(query, kv_cache, meta, scale):
    return OPS.attention(query, kv_cache, meta, scale)


def store_kv(key, value, kv_cache, slot_mapping):
    OPS.store_kv(key, value, kv_cache, slot_mapping)


@pytest.fixture(autouse=True, params=["c-kernel", "torch"])
def decode_path(request, monkeypatch):
    """Every test runs the decodes through the C kernel and through the torch path (the CPU backend's ops
    with its C attention on or off)."""
    monkeypatch.setattr(
        sys.modules[__name__], "OPS", CpuOps(KernelConfig(cpu_attention=request.param == "c-kernel"))
    )
    return request.param


@pytest.fixture(autouse=True, params=["token-major", "head-major"])
def cache_layout(request, monkeypatch):
    """Every cache _setup builds comes token-major and head-major (the CPU's layout, gpu/loader.py)."""
    monkeypatch.setattr(sys.modules[__name__], "LAYOUT", request.param)
    return request.param


LAYOUT = "token-major"


def _in_layout(kv_cache: torch.Tensor) -> torch.Tensor:
    """The same cache contents, laid out as LAYOUT says (the shape is the same either way)."""
    if LAYOUT == "token-major":
        return kv_cache
    two, blocks, size, heads, dim = kv_cache.shape
    head_major = torch.empty(two, blocks, heads, size, dim, dtype=kv_cache.dtype).transpose(2, 3)
    head_major.copy_(kv_cache)
    assert head_major.stride(3) == size * dim
    return head_major


# (query_len, seq_len) per request, decodes first: decodes, chunks from 0 and mid-sequence chunks.
BATCHES = [
    [(1, 1), (1, 7), (1, 17), (5, 5), (4, 13), (9, 9), (3, 20)],
    [(1, 33), (1, 2)],  # decodes only
    [(6, 6)],  # one prefill from 0
    [(7, 30), (2, 2), (1, 5)],  # prefill-only batch whose last chunk is one token
]


def _setup(batch, block_size, group, seed=0):
    """Dense per-request Q/K/V, a shuffled paged cache holding K/V, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    blocks_per_req = [-(-s // block_size) for _, s in batch]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay unused
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_req) + 1
    # Padding entries point at real (unrelated) blocks, as a reused block-table row would.
    block_table = torch.full((len(batch), max_blocks), perm[-1], dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor(perm[cursor : cursor + n])
        cursor += n
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=gen))
    dense = []
    for _, seq_len in batch:
        q = torch.randn(seq_len, num_heads, HEAD_SIZE, generator=gen)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        dense.append((q, k, v))
    # Earlier steps wrote the context; this step's store writes the new tokens' K/V.
    context = AttentionMetadata.build([s for _, s in batch], [s for _, s in batch], block_table, block_size)
    store_kv(
        torch.cat([k for _, k, _ in dense]),
        torch.cat([v for _, _, v in dense]),
        kv_cache,
        context.slot_mapping,
    )
    meta = AttentionMetadata.build([q for q, _ in batch], [s for _, s in batch], block_table, block_size)
    query = torch.cat([q[s - n :] for (n, s), (q, _, _) in zip(batch, dense, strict=True)])
    return query, kv_cache, meta, dense


def _dense_attention(batch, dense, scale):
    outs = []
    for (q_len, _), (q, k, v) in zip(batch, dense, strict=True):
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1).transpose(0, 1)
        v = v.repeat_interleave(group, 1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=scale)
        outs.append(out.transpose(0, 1)[-q_len:])
    return torch.cat(outs)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("batch", BATCHES)
def test_paged_attention_matches_reference_and_dense(batch, block_size, group):
    query, kv_cache, meta, dense = _setup(batch, block_size, group)
    scale = HEAD_SIZE**-0.5
    out = paged_attention(query, kv_cache, meta, scale)
    assert out.shape == query.shape
    torch.testing.assert_close(
        out, paged_attention_reference(query, kv_cache, meta, scale), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(out, _dense_attention(batch, dense, scale), atol=1e-5, rtol=0)


def test_metadata_and_store_kv_slots():
    block_table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    meta = AttentionMetadata.build([1, 3], [6, 7], block_table, block_size=4)
    assert meta.num_decodes == 1 and meta.num_actual_tokens == 4
    assert meta.query_start_loc_cpu == [0, 1, 4] and meta.max_seq_len == 7
    # req 0 position 5 -> block 0 offset 1; req 1 positions 4..6 -> block 2 offsets 0..2.
    assert meta.slot_mapping.tolist() == [1, 8, 9, 10]
    kv_cache = _in_layout(torch.zeros(2, 4, 4, 1, 2))
    key = torch.arange(8.0).view(4, 1, 2)
    store_kv(key, -key, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache[0, 2, :3], key[1:])
    assert torch.equal(kv_cache[1, 0, 1], -key[0])


def test_padded_query_rows_are_zero():
    batch = [(1, 9), (4, 10)]
    query, kv_cache, meta, dense = _setup(batch, 4, 2)
    padded = torch.cat([query, torch.randn(3, *query.shape[1:])])
    out = paged_attention(padded, kv_cache, meta, 0.3)
    assert torch.count_nonzero(out[-3:]) == 0
    torch.testing.assert_close(out[:-3], paged_attention(query, kv_cache, meta, 0.3))


def test_low_precision_runs_close_to_fp32():
    batch = [(1, 9), (1, 20), (5, 12)]
    query, kv_cache, meta, _ = _setup(batch, 4, 2)
    ref = paged_attention(query, kv_cache, meta, 0.3)
    out = paged_attention(query.bfloat16(), kv_cache.bfloat16(), meta, 0.3)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


def test_decodes_split_into_length_groups(monkeypatch):
    monkeypatch.setattr(
        sys.modules[__name__], "OPS", CpuOps(KernelConfig(cpu_attention=False))
    )  # the torch plan
    batch = [(1, s) for s in (3, 40, 7, 22, 1, 9, 33, 5, 14)] + [(3, 11)]
    query, kv_cache, meta, dense = _setup(batch, 4, 3)
    # Small thresholds, so this small batch splits; the first layer's plan is what later layers reuse.
    meta.decode_groups = reference.plan_decode_groups(
        meta.seq_lens_cpu[: meta.num_decodes], query.device, min_split_tokens=8, max_group_tokens=60
    )
    out = paged_attention(query, kv_cache, meta, 0.3)
    assert len(meta.decode_groups) > 2
    torch.testing.assert_close(out, _dense_attention(batch, dense, 0.3), atol=1e-5, rtol=0)
    torch.testing.assert_close(out, paged_attention(query, kv_cache, meta, 0.3))  # reused plan


def test_workspace_made_under_inference_mode_works_outside_it():
    query, kv_cache, meta, _ = _setup([(1, 9), (4, 10)], 4, 2)
    results = []

    def run() -> None:  # a fresh thread: its workspace (thread-local) is first made under inference_mode
        with torch.inference_mode():
            results.append(paged_attention(query, kv_cache, meta, 0.3))
        with torch.no_grad():
            results.append(paged_attention(query, kv_cache, meta, 0.3))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert len(results) == 2
    torch.testing.assert_close(results[1], results[0])


def test_the_c_decode_kernel_builds_here():
    from aioengine.kernels.cpu import clib as cpu_kernels

    assert cpu_kernels.load() is not None, "gcc should build cpu_decode_attention.c on this machine"


def test_loading_the_c_kernels_keeps_subnormal_floats():
    """gcc < 13 links -ffast-math's crtfastmath.o into shared libraries too: loading one would turn on
    flush-to-zero in the loading thread (hypothesis, numpy and torch then see subnormals vanish)."""
    code = (
        "from aioengine.kernels.cpu import clib as cpu_kernels; import torch\n"
        "assert cpu_kernels.load() is not None\n"
        "assert 5e-324 * 1.0 > 0 and (torch.tensor([1e-40]) * 1.0).item() > 0, 'flush-to-zero is on'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("window", [None, 1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim"), [(16, 3, 64), (4, 1, 8), (32, 4, 128), (8, 8, 32)]
)
def test_c_decode_kernel_matches_reference(dtype, block_size, group, head_dim, window):
    from aioengine.kernels.cpu import clib as cpu_kernels

    gen = torch.Generator().manual_seed(block_size * group)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 77]
    max_blocks = -(-max(seq_lens) // block_size) + 1
    num_blocks = len(seq_lens) * max_blocks + 1
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, 2, head_dim, generator=gen).to(dtype))
    block_table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    meta = AttentionMetadata.build(
        [1] * len(seq_lens), seq_lens, block_table.view(len(seq_lens), -1), block_size
    )
    query = torch.randn(len(seq_lens), 2 * group, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.decode_attention(query, kv_cache, meta.block_table, meta.seq_lens, scale, window)
    ref = paged_attention_reference(query, kv_cache, meta, scale, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 300, 511])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_decode_kernel_cuts_long_sequences_into_runs(dtype, window):
    """Sequences past 256 positions are cut into runs spread over the threads and merged: equal to the
    reference, and each request's output is the same bits alone as in the batch (its runs depend on its
    length only)."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    block_size, group, head_dim = 16, 3, 64
    gen = torch.Generator().manual_seed(11)
    seq_lens = [1, 256, 257, 700, 1030, 40]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, 2, head_dim, generator=gen).to(dtype))
    block_table = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_blocks)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, block_table, block_size)
    query = (4 * torch.randn(len(seq_lens), 2 * group, head_dim, generator=gen)).to(dtype)
    out = cpu_kernels.decode_attention(query, kv_cache, meta.block_table, meta.seq_lens, 0.125, window)
    ref = paged_attention_reference(query, kv_cache, meta, 0.125, window=window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for i, n in enumerate(seq_lens):
        alone = AttentionMetadata.build([1], [n], block_table[i : i + 1], block_size)
        one = cpu_kernels.decode_attention(
            query[i : i + 1], kv_cache, alone.block_table, alone.seq_lens, 0.125, window
        )
        assert torch.equal(one, out[i : i + 1]), n


@pytest.mark.parametrize("block_size", [16, 32, 8])
def test_c_decode_kernel_ignores_stale_slots_holding_nan(block_size):
    """Slots past a request's length (freed by another request, never written) may hold any bits."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    gen = torch.Generator().manual_seed(7)
    seq_lens = [1, 5, block_size + 3, 2 * block_size - 1]
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks
    kv_cache = _in_layout(torch.full((2, num_blocks, block_size, 2, 64), float("nan"), dtype=torch.bfloat16))
    block_table = torch.arange(num_blocks).view(len(seq_lens), max_blocks)
    for i, n in enumerate(seq_lens):
        for p in range(n):
            kv_cache[:, block_table[i, p // block_size], p % block_size] = torch.randn(
                2, 2, 64, generator=gen
            )
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, block_table, block_size)
    query = torch.randn(len(seq_lens), 6, 64, generator=gen).to(torch.bfloat16)
    out = cpu_kernels.decode_attention(query, kv_cache, meta.block_table, meta.seq_lens, 0.125)
    ref = paged_attention_reference(query, kv_cache, meta, 0.125)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("batch", BATCHES + [[(1, 40), (37, 37), (20, 70)]])
def test_bf16_mixed_batches_match_the_reference(batch, block_size, group, monkeypatch):
    """bf16 with head_dim 64: on AVX512-BF16 the prefill chunks run as per-token rows of the C kernel."""
    monkeypatch.setattr(sys.modules[__name__], "HEAD_SIZE", 64)
    query, kv_cache, meta, _ = _setup(batch, block_size, group)
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    assert kv_cache.stride() == _in_layout(kv_cache).stride()  # the cast kept the layout
    padded = torch.cat([query, torch.randn(2, *query.shape[1:]).bfloat16()])
    out = paged_attention(padded, kv_cache, meta, 0.125)
    assert torch.count_nonzero(out[-2:]) == 0
    ref = paged_attention_reference(query, kv_cache, meta, 0.125)
    torch.testing.assert_close(out[:-2].float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_store_kv_skips_padded_and_out_of_range_slots():
    """-1 marks a padded row (CUDA graphs pad with it); nothing outside the cache is ever written."""
    kv_cache = _in_layout(torch.zeros(2, 3, 4, 2, 8))
    key = torch.arange(4 * 2 * 8, dtype=torch.float32).view(4, 2, 8) + 1
    store_kv(key, -key, kv_cache, torch.tensor([5, -1, 12, 0]))
    assert torch.equal(kv_cache[0, 1, 1], key[0]) and torch.equal(kv_cache[1, 0, 0], -key[3])
    assert torch.count_nonzero(kv_cache[0]) == 2 * 2 * 8  # only the two in-range slots


@pytest.mark.parametrize("spread", [1.0, 3.0])
def test_bf16_c_kernel_is_within_one_ulp_of_the_exact_answer(spread):
    """The C kernel sums in float32 (p.V with the probabilities as two bf16 parts), so its bf16 outputs sit
    within one ulp of the float64 answer; one bf16 rounding of p alone misses that."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    if cpu_kernels.load() is None or not cpu_kernels.load().decode_attention_bf16_vectorized():
        pytest.skip("the AVX512-BF16 loop is not built here")
    gen = torch.Generator().manual_seed(3)
    kv_cache = _in_layout((torch.randn(2, 27, 16, 3, 64, generator=gen) * spread).bfloat16())
    seq_lens = [40, 130, 7]
    table = torch.randperm(27, generator=gen)[:27].view(3, 9).int()  # 9 blocks a row: room for 130 tokens
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, table, 16)
    query = (torch.randn(3, 9, 64, generator=gen) * spread).bfloat16()
    out = cpu_kernels.decode_attention(query, kv_cache, meta.block_table, meta.seq_lens, 0.125)
    exact = paged_attention_reference(query, kv_cache, meta, 0.125)  # float64 inside, one final rounding
    ulps = (out.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    assert ulps.max() <= 1, ulps.max()


@pytest.mark.parametrize(
    ("q_len", "seq_len", "group", "head_dim", "block_size"),
    [
        (100, 250, 3, 64, 16),  # a chunk after a cached prefix
        (70, 70, 1, 128, 32),  # a prompt from position 0, one query head per KV head
        (33, 97, 8, 96, 16),  # head_dim 96; tokens beyond a 16-token tile
        (40, 41, 16, 32, 8),  # 16 query heads per KV head: two tokens a task
        (32, 300, 2, 256, 64),  # the widest head
    ],
)
def test_packed_prefill_kernel_is_within_one_ulp_of_the_exact_answer(
    q_len, seq_len, group, head_dim, block_size
):
    """cpu_prefill_attention.c: keys and values packed once per chunk, 64-key softmax updates; still float32
    sums and p.V in two bf16 parts, so outputs are within one ulp of the float64 answer (outputs near zero,
    where float32 sums of +-1 terms cancel, within 1e-5: the decode kernel's rows do the same)."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    if cpu_kernels.load() is None or not cpu_kernels.load().decode_attention_bf16_vectorized():
        pytest.skip("the AVX512-BF16 loop is not built here")
    gen = torch.Generator().manual_seed(q_len)
    num_blocks = -(-seq_len // block_size) + 5
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, 2, head_dim, generator=gen).bfloat16())
    table = torch.randperm(num_blocks, generator=gen)[None].int()
    meta = AttentionMetadata.build([q_len], [seq_len], table, block_size)
    query = torch.randn(q_len, 2 * group, head_dim, generator=gen).bfloat16()
    assert cpu_kernels.fast_prefill(query, kv_cache)
    out = cpu_kernels.prefill_attention(query, kv_cache, table[0], seq_len, head_dim**-0.5)
    exact = paged_attention_reference(query, kv_cache, meta, head_dim**-0.5)
    _assert_within_one_ulp(out, exact)


@pytest.mark.parametrize(
    ("q_len", "seq_len", "window", "block_size"),
    [
        (100, 250, 64, 16),  # a chunk after a prefix longer than the window
        (70, 70, 19, 16),  # a prompt from 0: the window starts mid-tile for most rows
        (40, 600, 512, 16),  # Gemma 3's window; the first row's window starts mid-chunk
        (5, 300, 1, 8),  # a token sees only itself
        (64, 200, 64, 32),  # windows that end on chunk boundaries
    ],
)
def test_windowed_packed_prefill_is_within_one_ulp_and_reads_no_block_before_the_window(
    q_len, seq_len, window, block_size
):
    """cpu_prefill_attention.c with a sliding window: each row sees itself and ``window - 1`` earlier
    positions; blocks wholly before every row's window (freed ones, here NaN) are never read."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    if cpu_kernels.load() is None or not cpu_kernels.load().decode_attention_bf16_vectorized():
        pytest.skip("the AVX512-BF16 loop is not built here")
    gen = torch.Generator().manual_seed(seq_len + window)
    num_blocks = -(-seq_len // block_size) + 3
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, 2, 64, generator=gen).bfloat16())
    table = torch.randperm(num_blocks, generator=gen)[None].int()
    meta = AttentionMetadata.build([q_len], [seq_len], table, block_size)
    query = torch.randn(q_len, 6, 64, generator=gen).bfloat16()
    exact = paged_attention_reference(query, kv_cache, meta, 0.125, window=window)
    for b in range(max(0, seq_len - q_len - window + 1) // block_size):
        kv_cache[:, int(table[0, b])] = float("nan")
    out = cpu_kernels.prefill_attention(query, kv_cache, table[0], seq_len, 0.125, window)
    _assert_within_one_ulp(out, exact)
    # the backend takes the same kernel for windowed layers' chunks
    via_ops = OPS.attention(query, kv_cache, meta, 0.125, window=window)
    if OPS.c_prefill and cpu_kernels.fast_prefill(query, kv_cache):
        assert torch.equal(via_ops.view(torch.int16), out.view(torch.int16))


def _assert_within_one_ulp(out: torch.Tensor, exact: torch.Tensor) -> None:
    ulps = (out.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    large = exact.float().abs() >= 1e-3
    assert ulps[large].max() <= 1, ulps[large].max()
    assert (out.float() - exact.float())[~large].abs().max() <= 1e-5


def test_decodes_and_prompt_chunks_share_one_batch(decode_path):
    """Decodes (decode kernel) and prompt chunks of 40, 5 and 64 tokens (packed kernel) in one bf16 step."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    batch = [(1, 50), (1, 9), (40, 40), (5, 60), (64, 130)]
    sys.modules[__name__].HEAD_SIZE, saved = 64, HEAD_SIZE
    try:
        query, kv_cache, meta, _ = _setup(batch, 16, 3)
    finally:
        sys.modules[__name__].HEAD_SIZE = saved
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    out = paged_attention(query, kv_cache, meta, 0.125)
    exact = paged_attention_reference(query, kv_cache, meta, 0.125)
    if decode_path == "c-kernel" and cpu_kernels.fast_prefill(query, kv_cache):
        _assert_within_one_ulp(out, exact)
    else:  # the torch path: SDPA in bf16
        torch.testing.assert_close(out.float(), exact.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 40, 100])
@pytest.mark.parametrize("block_size", [16, 8])
def test_a_prompts_bits_do_not_depend_on_its_chunking(block_size, window):
    """The packed prefill kernel gives every prompt token the same bits whether the prompt comes whole, in
    budget-sized chunks, or as the one-token tail a prefix-cache hit recomputes: a cached prefix must not
    change a greedy answer."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    if cpu_kernels.load() is None or not cpu_kernels.load().decode_attention_bf16_vectorized():
        pytest.skip("the AVX512-BF16 loop is not built here")
    gen = torch.Generator().manual_seed(5)
    seq_len = 300
    num_blocks = -(-seq_len // block_size) + 3
    kv_cache = _in_layout(torch.randn(2, num_blocks, block_size, 3, 64, generator=gen).bfloat16())
    table = torch.randperm(num_blocks, generator=gen).int()
    query = torch.randn(seq_len, 9, 64, generator=gen).bfloat16()
    whole = cpu_kernels.prefill_attention(query, kv_cache, table, seq_len, 0.125, window)
    for cuts in ([1, 15, 16, 17, 64, 100], [299], [63, 64, 65], list(range(250, 300))):
        parts, start = [], 0
        for end in [*cuts, seq_len]:
            parts.append(cpu_kernels.prefill_attention(query[start:end], kv_cache, table, end, 0.125, window))
            start = end
        assert torch.equal(torch.cat(parts).view(torch.int16), whole.view(torch.int16)), cuts


def test_the_kernels_exp_is_within_two_ulp_of_the_exact_one():
    """exp16 (cpu_avx512.h) replaced libm's expf in both attention kernels: its range reduction and series
    must hold float32 accuracy over the whole range softmax feeds it, and keep -inf -> 0, NaN -> NaN,
    overflow -> inf."""
    from aioengine.kernels.cpu import clib as cpu_kernels

    lib = cpu_kernels.load()
    x = torch.cat(
        [
            torch.linspace(-87.0, 88.7, 200_003),
            torch.tensor([0.0, -0.0, 1e-30, -1e-30]),
            torch.randn(10_000) * 10,
        ]
    ).float()
    out = torch.empty_like(x)
    if lib is None or lib.exp_f32(x.data_ptr(), out.data_ptr(), x.numel()) != 0:
        pytest.skip("the AVX512 loops are not built here")
    exact = x.double().exp()
    assert ((out.double() - exact).abs() / exact).max() <= 2 * 2.0**-24 * 1.01  # 2 ulp of float32
    special = torch.tensor([float("-inf"), float("nan"), float("inf"), 89.0, -104.0, -200.0, 1.0, 2.0, 3.0])
    got = torch.empty_like(special)
    assert lib.exp_f32(special.data_ptr(), got.data_ptr(), special.numel()) == 0
    assert got[0] == 0 and got[1].isnan() and got[2] == float("inf") and got[3] == float("inf")
    assert got[4] == 0 and got[5] == 0
    torch.testing.assert_close(got[6:], special[6:].exp())


def _dense_windowed(batch, dense, scale, window):
    outs = []
    for (q_len, _), (q, k, v) in zip(batch, dense, strict=True):
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, 1).transpose(0, 1)
        v = v.repeat_interleave(group, 1).transpose(0, 1)
        n = q.shape[0]
        pos = torch.arange(n)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1)[-q_len:])
    return torch.cat(outs)


@pytest.mark.parametrize("window", [1, 5, 8, 19])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", BATCHES)
def test_sliding_window_attention_matches_reference_and_dense(batch, block_size, window):
    """A window sees itself and window - 1 earlier positions, in decodes and chunks alike; blocks wholly
    before every query's window are never read (here they hold NaN, as freed blocks may)."""
    query, kv_cache, meta, dense = _setup(batch, block_size, group=2)
    scale = HEAD_SIZE**-0.5
    want = _dense_windowed(batch, dense, scale, window)
    torch.testing.assert_close(
        paged_attention_reference(query, kv_cache, meta, scale, window=window), want, atol=1e-5, rtol=0
    )
    poisoned = kv_cache.clone()
    for i, (q_len, seq_len) in enumerate(batch):
        first_needed = max(0, seq_len - q_len - window + 1)
        for b in range(first_needed // block_size):
            poisoned[:, int(meta.block_table[i, b])] = float("nan")
    out = OPS.attention(query, poisoned, meta, scale, window=window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("slice_scores", [1 << 26, 16], ids=["whole", "row-slices"])
def test_sinks_match_the_float64_reference_whole_or_in_row_slices(monkeypatch, window, slice_scores):
    """gpt-oss's sinks through the torch path (every backend sends such layers there), decodes and prompt
    chunks, with the score matrix computed whole or a few query rows at a time (a long prompt's)."""
    monkeypatch.setattr(reference, "_SINK_SCORES", slice_scores)
    query, kv_cache, meta, _ = _setup(BATCHES[0], 4, 3)
    sinks = torch.randn(query.shape[1], generator=torch.Generator().manual_seed(3)) * 2
    scale = HEAD_SIZE**-0.5
    out = OPS.attention(query, kv_cache, meta, scale, window=window, sinks=sinks)
    ref = paged_attention_reference(query, kv_cache, meta, scale, window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    plain = paged_attention_reference(query, kv_cache, meta, scale, window=window)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks moved the output
