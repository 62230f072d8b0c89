"""RoPE scalings beyond llama3: linear and YaRN take transformers' own frequencies (and YaRN's attention
factor); greedy tokens equal transformers' past the original context. Length-dependent scalings refuse."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import NEW_TOKENS, hf_greedy

SCALINGS = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaled_rope_matches_transformers(tmp_path, name):
    kind, scaling = SCALINGS[name]
    hf = make_tiny_checkpoint(kind, tmp_path, rope_scaling=scaling)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 70, 150)]  # past the original 64
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run() -> list[list[int]]:
        async with AsyncEngine(
            EngineArgs(
                model=str(tmp_path), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=64
            )
        ) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(run()) == expected


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_the_scaled_tables_differ_from_the_default(tmp_path, name):
    """The parity above is not passing by accident: each scaling changes the cos/sin table."""
    from aioengine.gpu.layers import RotaryEmbedding, get_rope

    kind, scaling = SCALINGS[name]
    hf = make_tiny_checkpoint(kind, tmp_path, rope_scaling=scaling)
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    scaled = get_rope(head_dim, 256, hf.config, torch.float32)
    plain = RotaryEmbedding(head_dim, 256, 10000.0)
    assert not torch.allclose(plain.cos_sin_cache, scaled.cos_sin_cache, atol=1e-3)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_length_dependent_scalings_refuse(tmp_path, scaling):
    from aioengine.gpu.layers import get_rope

    hf = make_tiny_checkpoint("llama", tmp_path, rope_scaling=scaling)
    with pytest.raises(NotImplementedError, match=scaling["rope_type"]):
        get_rope(16, 256, hf.config, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_max_model_len_past_max_position_embeddings_extrapolates_as_transformers_does(tmp_path, dtype):
    """The rotary table used to end at max_position_embeddings: positions past it read beyond the table
    (garbage tokens, or a crash). Now it covers max_model_len; in float32 the tokens are transformers'
    (which computes RoPE for any position); in bf16 (the C kernels and the one-call decode stack read the
    same table) the run completes over a table that covers every position."""
    hf = make_tiny_checkpoint("llama", tmp_path, max_position_embeddings=48, rope_scaling=None)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (40, 90)]  # past the 48 positions

    async def run() -> tuple[list[list[int]], int]:
        async with AsyncEngine(
            EngineArgs(
                model=str(tmp_path),
                dtype=dtype,
                device="cpu",
                block_size=4,
                max_num_batched_tokens=64,
                max_model_len=160,
            )
        ) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            rows = engine.runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.shape[0]
            return [o.outputs[0].token_ids for o in outs], rows

    got, rows = asyncio.run(run())
    assert rows >= 160
    if dtype == "float32":
        assert got == [hf_greedy(hf, p) for p in prompts]
    else:
        assert all(len(t) == NEW_TOKENS for t in got)
