"""Sliding-window configs run past their window: each layer's window comes from the config, and tokens
equal transformers' (which applies the same windows) on requests several windows long."""

from __future__ import annotations

import asyncio
import random

import pytest
import transformers

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.models import sliding_window
from aioengine.gpu.models.llama import layer_windows
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import NEW_TOKENS, hf_greedy

WINDOW = 32  # conftest's tiny Mistral


def test_which_configs_have_a_window():
    assert sliding_window({"sliding_window": 4096}) == 4096  # Mistral v0.1
    assert sliding_window({"sliding_window": None}) is None  # Mistral v0.2+
    assert sliding_window({"sliding_window": 4096, "use_sliding_window": False}) is None  # Qwen2's default
    assert sliding_window({"sliding_window": 4096, "use_sliding_window": True}) == 4096
    assert sliding_window({}) is None


def test_each_layer_takes_its_window_from_the_config():
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=64)
    assert layer_windows(mistral) == [64, 64, 64]
    qwen = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=2
    )
    assert layer_windows(qwen) == [None, None, 64, 64]  # as transformers' layer_types says
    assert layer_windows(transformers.Qwen2Config(num_hidden_layers=2)) == [None, None]


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral-long")
    return path, make_tiny_checkpoint("mistral", path)


def test_requests_several_windows_long_match_transformers(tiny_mistral):
    """Past the window, with chunks that start before it and end after it: no cap on the context."""
    path, hf = tiny_mistral
    rng = random.Random(3)
    prompts = [
        [rng.randrange(3, 49152) for _ in range(n)] for n in (5, WINDOW - 1, WINDOW + 1, 3 * WINDOW + 7)
    ]
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run():
        args = EngineArgs(
            model=str(path),
            dtype="float32",
            device="cpu",
            block_size=4,
            max_model_len=8 * WINDOW,
            max_num_batched_tokens=24,
        )
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return engine.max_model_len, [o.outputs[0].token_ids for o in outs]

    max_model_len, got = asyncio.run(run())
    assert max_model_len == 8 * WINDOW and got == expected


@pytest.fixture(scope="module")
def tiny_gemma3_w64(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3-w64")
    return path, make_tiny_checkpoint("gemma3", path, sliding_window=64, max_position_embeddings=4096)


def test_a_4000_token_request_fits_a_pool_only_the_hybrid_manager_can_serve(tiny_gemma3_w64):
    """One full and one window-64 layer, 16-token blocks, 256-token chunks: the full group needs 251 blocks,
    the windowed one at most cdiv(63 + 256, 16) + 1 = 21 (kv_cache_spec.window_blocks_bound). A pool of
    1 + 251 + 21 blocks serves it only if windowed blocks are freed as they fall out of the window; the
    tokens equal transformers' and the pool is empty after."""
    path, hf = tiny_gemma3_w64
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(4000)]
    expected = hf_greedy(hf, prompt)

    async def run():
        args = EngineArgs(
            model=str(path),
            dtype="float32",
            device="cpu",
            block_size=16,
            max_model_len=4096,
            max_num_batched_tokens=256,
            num_kv_blocks=1 + 251 + 21,
        )
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            out = await engine.generate(prompt, params)
            sched = engine.scheduler
            return out.outputs[0].token_ids, engine.kv_cache_usage(), sched.num_preemptions_total

    got, usage, preemptions = asyncio.run(run())
    assert got == expected and usage == 0.0 and preemptions == 0
