"""Backends are per engine: two engines with different kernel choices run side by side in one process."""

from __future__ import annotations

import asyncio

import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.config import KernelConfig
from aioengine.gpu.backends import make_backend
from aioengine.gpu.cpu.backend import CpuBackend
from aioengine.kernels.cpu import clib

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_make_backend_follows_the_device_and_the_kernel_config():
    backend = make_backend(EngineArgs(device="cpu", kernels=KernelConfig(cpu_attention=False), num_threads=1))
    assert isinstance(backend, CpuBackend) and backend.name == "cpu"
    assert not backend.ops.c_attention and backend.ops.elementwise
    with pytest.raises(ValueError, match="cpu_linear"):
        EngineArgs(kernels=KernelConfig(cpu_linear="mkl")).validate()


@pytest.mark.skipif(clib.load() is None, reason="no C compiler here")
def test_two_engines_with_different_kernels_in_one_process(monkeypatch):
    """One engine decodes through the C attention kernel, the other through torch's SDPA, at the same time:
    each keeps its own choice (nothing process-wide), and both answer the same greedy text."""
    calls: dict[int, int] = {}
    real = clib.decode_attention

    def counting(query, *args, **kwargs):  # observes which engine's worker thread called the C kernel
        import threading

        calls[threading.get_ident()] = calls.get(threading.get_ident(), 0) + 1
        return real(query, *args, **kwargs)

    monkeypatch.setattr(clib, "decode_attention", counting)

    async def main():
        # No one-call decode stack (AVX512-BF16 builds): its decodes would not pass through decode_attention.
        fast = AsyncEngine(
            EngineArgs(model="default", num_threads=1, kernels=KernelConfig(cpu_decode_stack=False))
        )
        plain = AsyncEngine(
            EngineArgs(model="default", num_threads=1, kernels=KernelConfig(cpu_attention=False))
        )
        async with fast, plain:
            params = SamplingParams(temperature=0, max_tokens=12)
            a, b = await asyncio.gather(fast.chat(PROMPT, params), plain.chat(PROMPT, params))
            idents = [await e.run_on_worker(_thread_ident) for e in (fast, plain)]
            return a, b, idents, fast.backend.ops.c_attention, plain.backend.ops.c_attention

    a, b, (fast_thread, plain_thread), fast_c, plain_c = asyncio.run(main())
    assert fast_c and not plain_c
    assert calls.get(fast_thread, 0) > 0, "the C-kernel engine never ran the C decode kernel"
    assert calls.get(plain_thread, 0) == 0, "the torch engine ran the C decode kernel"
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert "Paris" in a.outputs[0].text


def _thread_ident() -> int:
    import threading

    return threading.get_ident()
