"""The CUDA path on a GPU (skipped without one): layer dispatch to the Triton kernels at bf16 tolerance,
awaiting a real CUDA event (host function and polling), decode graphs against eager, KV sizing."""

from __future__ import annotations

import asyncio

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
BF16 = dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layers_dispatch_to_triton_and_match_the_torch_path(dtype):
    from aioengine.gpu.cuda.backend import CudaOps
    from aioengine.gpu.layers import RMSNorm, RotaryEmbedding, SiluAndMul
    from aioengine.kernels.reference import add_rms_norm as rms_norm_reference
    from aioengine.kernels.reference import rotary as rotary_reference
    from aioengine.kernels.reference import silu_and_mul as silu_and_mul_reference

    torch.manual_seed(0)
    dev = "cuda"
    ops = CudaOps()  # what the CUDA backend hands the layers
    norm = RMSNorm(4096, 1e-5, dtype, dev, ops)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(37, 4096, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5), **BF16)
    out, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res, **BF16)
    torch.testing.assert_close(out, rms_norm_reference(x + res, norm.weight, 1e-5), **BF16)
    head_norm = RMSNorm(128, 1e-6, dtype, dev, ops)  # Qwen3's per-head norm on a strided view of qkv
    qkv = torch.randn(37, 48 * 128, dtype=dtype, device=dev)
    q = qkv[:, : 32 * 128].view(37, 32, 128)
    torch.testing.assert_close(head_norm(q), rms_norm_reference(q, head_norm.weight, 1e-6), **BF16)
    rope = RotaryEmbedding(
        128,
        4096,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        dtype=dtype,
        device=dev,
        ops=ops,
    )
    k = qkv[:, 32 * 128 : 40 * 128].view(37, 8, 128)
    positions = torch.randint(0, 4096, (37,), device=dev)
    q_rot, k_rot = rope(positions, q, k)
    q_ref, k_ref = rotary_reference(positions, q, k, rope.cos_sin_cache)
    torch.testing.assert_close(q_rot, q_ref, **BF16)
    torch.testing.assert_close(k_rot, k_ref, **BF16)
    gate_up = torch.randn(37, 2 * 14336, dtype=dtype, device=dev)
    torch.testing.assert_close(SiluAndMul(ops)(gate_up), silu_and_mul_reference(gate_up), **BF16)


async def _with_ticker(coro):
    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await coro
    done = True
    await t
    return ticks


@pytest.mark.parametrize("use_host_func", [True, False])
def test_await_cuda_event_resumes_after_the_gpu_without_blocking_the_loop(use_host_func):
    from aioengine.gpu.cuda.async_output import HostFunctions, await_cuda_event

    stream = torch.cuda.Stream()
    hosts = (
        HostFunctions()
    )  # made first: its first use loads cuda-python, which took longer than a short spin
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU spinning
        event = torch.cuda.Event()
        event.record(stream)
    signal = hosts.signal_after(stream) if use_host_func else None
    if use_host_func:
        pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed")
        assert signal is not None, "cudaLaunchHostFunc failed"
    assert not event.query()
    ticks = asyncio.run(_with_ticker(await_cuda_event(event, signal)))
    assert event.query() and ticks > 10
    if use_host_func:
        assert signal.is_set(), "the wait ended without the host function (its watchdog fired)"


def test_decode_graph_replay_matches_eager():
    from aioengine.gpu.cuda.backend import CudaBackend
    from aioengine.gpu.cuda.graphs import DecodeGraphs
    from aioengine.gpu.random_model import build_random_model
    from aioengine.kernels.metadata import AttentionMetadata

    backend = CudaBackend()
    model, config = build_random_model("random:tiny", torch.float32, "cuda", seed=2, ops=backend.ops)
    kv = backend.allocate_kv_caches(config, 64, 16, torch.float32)
    for t in kv:
        t.normal_()
    seq_lens = [17, 40, 5]
    table = torch.arange(1, 1 + 3 * 3, dtype=torch.int32, device="cuda").view(3, 3)
    meta = AttentionMetadata.build([1, 1, 1], seq_lens, table, 16)
    ids = torch.tensor([5, 9, 11], device="cuda")
    pos = torch.tensor(seq_lens, device="cuda") - 1
    with torch.inference_mode():
        expected = model(ids, pos, [t.clone() for t in kv], meta)
        graphs = DecodeGraphs(model, kv, max_size=8, max_blocks_per_req=8, device=torch.device("cuda"))
        assert graphs.capture([1, 2, 4, 8], time_limit_s=120) == [1, 2, 4, 8]
        got = graphs.run(ids, pos, meta)
        torch.cuda.synchronize()
    assert got.shape == expected.shape and graphs.num_replays == 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_profile_kv_blocks_measures_the_device():
    from aioengine.config import EngineArgs
    from aioengine.gpu.cuda.backend import CudaBackend
    from aioengine.gpu.model_runner import ModelRunner

    backend = CudaBackend()
    runner = ModelRunner("random:tiny", backend, torch.bfloat16, 16, 512, 16, 0)
    blocks = backend.num_kv_blocks(runner, EngineArgs(gpu_memory_utilization=0.5), 2048, 16)
    free, total = torch.cuda.mem_get_info()
    assert 0 < blocks * runner.kv_cache_bytes_per_block() < total * 0.5
