"""Decode CUDA graphs without a GPU: bucket sizes, padding into the static buffers, and the static-buffer
forward (what a graph captures) against the eager forward, with the Triton kernels interpreted on CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from aioengine.gpu.cpu.backend import CpuBackend  # noqa: E402
from aioengine.gpu.cuda.graphs import DecodeGraphs, bucket_for, capture_sizes, is_uniform_decode  # noqa: E402
from aioengine.gpu.random_model import build_random_model  # noqa: E402
from aioengine.kernels.metadata import AttentionMetadata  # noqa: E402


def test_capture_sizes_follow_the_tour():
    sizes = capture_sizes(max_num_seqs=1024, max_num_batched_tokens=8192)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-1] == 512 and 248 in sizes and 256 in sizes and 272 in sizes and 264 not in sizes
    assert sizes == sorted(set(sizes))


@pytest.mark.parametrize(
    ("seqs", "tokens", "last"), [(6, 8192, 6), (128, 64, 64), (1, 512, 1), (300, 8192, 300)]
)
def test_capture_sizes_end_at_the_limit(seqs, tokens, last):
    sizes = capture_sizes(seqs, tokens)
    assert sizes[-1] == last and all(s <= last for s in sizes)
    assert all(bucket_for(n, sizes) is not None for n in range(1, last + 1))


def test_a_larger_capture_cap_covers_every_decode_batch_up_to_max_num_seqs():
    sizes = capture_sizes(max_num_seqs=1024, max_num_batched_tokens=8192, cap=1024)
    assert sizes[-1] == 1024 and sizes[sizes.index(512) + 1] == 528
    assert all(bucket_for(n, sizes) is not None for n in range(1, 1025))


def test_bucket_for_picks_the_smallest_that_fits():
    sizes = [1, 2, 4, 8, 16]
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]
    assert bucket_for(1, []) is None


BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    model, config = build_random_model("random:tiny", torch.float32, "cpu", seed=3)
    return model, config


def _decode_meta(
    seq_lens: list[int], num_blocks: int
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    per_req = -(-max(seq_lens) // BLOCK)
    ids = (
        torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1))[: len(seq_lens) * per_req]
        + 1
    )
    table = ids.view(len(seq_lens), per_req).int()
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, table, BLOCK)
    input_ids = torch.arange(len(seq_lens), dtype=torch.int64) * 7 + 3
    positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
    return meta, input_ids, positions


def test_load_pads_rows_past_the_batch(tiny):
    model, config = tiny
    kv = CpuBackend().allocate_kv_caches(config, 40, BLOCK, torch.float32)
    graphs = DecodeGraphs(model, kv, max_size=8, max_blocks_per_req=16, device=torch.device("cpu"))
    meta, input_ids, positions = _decode_meta([5, 9, 3], 40)
    graphs.block_table.fill_(7)  # stale rows from an earlier step (one KV cache group: index 0)
    graphs.load(8, input_ids, positions, meta)
    assert graphs.input_ids[:3].tolist() == input_ids.tolist() and graphs.input_ids[3:].eq(0).all()
    assert graphs.positions[:3].tolist() == [4, 8, 2]
    assert (
        graphs.slot_mapping[0, :3].tolist() == meta.slot_mapping.tolist()
        and graphs.slot_mapping[0, 3:].eq(-1).all()
    )
    assert graphs.seq_lens[:3].tolist() == [5, 9, 3] and graphs.seq_lens[3:].eq(1).all()
    width = meta.block_table.shape[1]
    assert torch.equal(graphs.block_table[0, :3, :width], meta.block_table)
    assert graphs.block_table[0, 3:, 0].eq(0).all()  # padded rows read the null block
    m = graphs.metadata(8)
    assert m.num_reqs == m.num_decodes == m.num_actual_tokens == 8 and m.max_query_len == 1
    assert m.query_start_loc.tolist() == list(range(9))


def test_run_declines_batches_that_are_not_uniform_decodes(tiny):
    model, config = tiny
    graphs = DecodeGraphs(model, [], max_size=4, max_blocks_per_req=4, device=torch.device("cpu"))
    graphs.sizes = [1, 2, 4]
    prefill = AttentionMetadata.build([3, 1], [3, 5], torch.zeros(2, 2, dtype=torch.int32), BLOCK)
    assert graphs.run(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), prefill) is None
    big, ids, pos = _decode_meta([2] * 5, 40)
    assert graphs.run(ids, pos, big) is None  # 5 rows: no bucket holds them


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test; tests/gpu/cuda/test_device.py replays real graphs"
)
def test_static_forward_matches_eager_with_the_triton_kernels():
    """What a graph captures, run eagerly: padded rows write nothing and the real rows match."""
    model, config = build_random_model("random:tiny", torch.float32, "cpu", seed=3, ops=_triton_ops())
    seq_lens = [6, 11, 3]
    meta, input_ids, positions = _decode_meta(seq_lens, 24)
    got, expected, kv, kv_eager = _static_and_eager(model, config, 24, input_ids, positions, meta, meta, 4, 8)
    assert got.shape[0] == 4
    torch.testing.assert_close(got[:3], expected, atol=1e-4, rtol=1e-4)
    for a, b in zip(kv, kv_eager, strict=True):
        torch.testing.assert_close(a, b)  # same writes: the padded row stored nothing


def test_capture_sizes_with_drafts_reach_max_num_seqs_times_the_query():
    """A verified request is 1 + k decode rows: the sizes reach max_num_seqs x (1 + k), within the cap
    and the token budget."""
    sizes = capture_sizes(max_num_seqs=8, max_num_batched_tokens=8192, decode_query_len=4)
    assert sizes[-1] == 32 and all(bucket_for(n, sizes) is not None for n in range(1, 33))
    assert capture_sizes(256, 8192, decode_query_len=4)[-1] == 512  # the cap
    assert capture_sizes(256, 100, decode_query_len=4)[-1] == 100  # the budget
    assert capture_sizes(8, 8192) == capture_sizes(8, 8192, decode_query_len=1)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test; tests/engine/test_cuda_parity.py replays real graphs"
)
def test_verified_drafts_as_decode_rows_in_the_static_buffers_match_a_causal_query():
    """A request verifying 3 drafts reaches attention as 4 decode rows, each seeing the KV up to itself
    (model_runner.py): through the graph's static buffers (padded) they give what the same 4 tokens give as
    one causal query chunk, eagerly, and store the same KV."""
    model, config = build_random_model("random:tiny", torch.float32, "cpu", seed=3, ops=_triton_ops())
    table = torch.tensor([[3, 4, 0], [5, 6, 7]], dtype=torch.int32)  # B decodes at 7; A verifies 5..8
    input_ids = torch.tensor([11, 21, 22, 23, 24], dtype=torch.int64)
    positions = torch.tensor([6, 5, 6, 7, 8], dtype=torch.int64)
    chunk = AttentionMetadata.build([1, 4], [7, 9], table, BLOCK)
    rows = AttentionMetadata.build([1] * 5, [7, 6, 7, 8, 9], table[[0, 1, 1, 1, 1]], BLOCK)
    assert torch.equal(rows.slot_mapping, chunk.slot_mapping)
    assert is_uniform_decode(rows, 5) and not is_uniform_decode(chunk, 5)
    got, expected, kv, kv_eager = _static_and_eager(
        model, config, 12, input_ids, positions, chunk, rows, size=8, width=4
    )
    torch.testing.assert_close(got[:5], expected, atol=1e-4, rtol=1e-4)
    for a, b in zip(kv, kv_eager, strict=True):
        torch.testing.assert_close(a, b)


def _static_and_eager(model, config, num_blocks, input_ids, positions, eager_meta, static_meta, size, width):
    """The model eagerly over ``eager_meta`` and through the graph's static buffers (``size`` rows) over
    ``static_meta``, each on its own copy of one random KV cache: (static, eager, static KV, eager KV)."""
    torch.manual_seed(0)
    kv = [t.normal_() for t in CpuBackend().allocate_kv_caches(config, num_blocks, BLOCK, torch.float32)]
    kv_eager = [t.clone() for t in kv]
    with torch.inference_mode():
        expected = model(input_ids, positions, kv_eager, eager_meta)
        graphs = DecodeGraphs(model, kv, max_size=8, max_blocks_per_req=width, device=torch.device("cpu"))
        graphs.load(size, input_ids, positions, static_meta)
        got = graphs.forward(size)
    return got, expected, kv, kv_eager


def _triton_ops():
    from aioengine.gpu.backend import Ops
    from aioengine.kernels.triton.attention import paged_attention_triton
    from aioengine.kernels.triton.kv_store import store_kv_triton

    class TritonOps(Ops):  # the KV store and attention of the CUDA backend, interpreted
        def store_kv(self, key, value, kv_cache, slot_mapping):
            store_kv_triton(key, value, kv_cache, slot_mapping)

        def attention(self, query, kv_cache, meta, scale, window=None):
            return paged_attention_triton(query, kv_cache, meta, scale, window=window)

    return TritonOps()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter test; tests/gpu/cuda/test_device.py replays real graphs"
)
def test_static_forward_of_a_hybrid_model_matches_eager():
    """A windowed layer beside a full one: two KV cache groups, each with its own block table in the
    static buffers (blocks of one shared tensor); past the window, the graph's rows match eager."""
    import dataclasses

    from aioengine.gpu.models.llama import LlamaForCausalLM
    from aioengine.gpu.random_model import random_config, randomize_
    from aioengine.sched.kv_cache_spec import group_size, layer_slots

    config = random_config("random:tiny")
    config.sliding_window, config.layer_types = 5, ["sliding_attention", "full_attention"]
    with torch.no_grad():
        model = LlamaForCausalLM(config, ops=_triton_ops())
    randomize_(model, 3)
    groups = model.kv_cache_groups
    assert len(groups) == 2 and groups[1].sliding_window == 5
    seq_lens = [6, 11, 3]
    meta, input_ids, positions = _decode_meta(seq_lens, 24)
    # the windowed group's blocks: other ids of the same pool (blocks 1..23 are group 0's, 25..47 its)
    other = dataclasses.replace(
        meta, block_table=meta.block_table + 24, slot_mapping=meta.slot_mapping + 24 * BLOCK
    )
    meta.group_metadata = [meta, other]
    torch.manual_seed(0)
    tensors = [
        t.normal_()
        for t in CpuBackend().allocate_kv_caches(config, 48, BLOCK, torch.float32, group_size(groups))
    ]
    kv = [tensors[p] for _, p in layer_slots(groups, 2)]
    eager_tensors = [t.clone() for t in tensors]
    kv_eager = [eager_tensors[p] for _, p in layer_slots(groups, 2)]
    with torch.inference_mode():
        expected = model(input_ids, positions, kv_eager, meta)
        graphs = DecodeGraphs(model, kv, max_size=8, max_blocks_per_req=8, device=torch.device("cpu"))
        graphs.load(4, input_ids, positions, meta)
        got = graphs.forward(4)
    torch.testing.assert_close(got[:3], expected, atol=1e-4, rtol=1e-4)
    for a, b in zip(tensors, eager_tensors, strict=True):
        torch.testing.assert_close(a, b)
