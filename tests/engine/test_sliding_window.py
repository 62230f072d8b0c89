"""Sliding-window configs: with no windowed kernels the context is capped at the window, where windowed
attention equals full attention; tokens then equal transformers' (which does apply the window)."""

from __future__ import annotations

import asyncio
import random
import shutil

import pytest
import torch
import transformers

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.models import sliding_window
from aioengine.model_files import resolve_model
from tests.engine.conftest import SMALL
from tests.engine.test_parity import NEW_TOKENS, hf_greedy

WINDOW = 48


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral")
    torch.manual_seed(0)
    model = (
        transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=WINDOW))
        .float()
        .eval()
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    for f in resolve_model("default").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path, model


def test_which_configs_have_a_window():
    assert sliding_window({"sliding_window": 4096}) == 4096  # Mistral v0.1
    assert sliding_window({"sliding_window": None}) is None  # Mistral v0.2+
    assert sliding_window({"sliding_window": 4096, "use_sliding_window": False}) is None  # Qwen2's default
    assert sliding_window({"sliding_window": 4096, "use_sliding_window": True}) == 4096
    assert sliding_window({}) is None


def test_the_context_is_capped_at_the_window_and_tokens_match(tiny_mistral):
    path, hf = tiny_mistral
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 20, WINDOW - NEW_TOKENS)]
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run():
        async with AsyncEngine(
            EngineArgs(model=str(path), dtype="float32", device="cpu", block_size=4)
        ) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            return engine.max_model_len, [o.outputs[0].token_ids for o in outs]

    max_model_len, got = asyncio.run(run())
    assert max_model_len == WINDOW and got == expected


def test_asking_for_more_than_the_window_is_refused(tiny_mistral):
    async def run():
        async with AsyncEngine(
            EngineArgs(model=str(tiny_mistral[0]), dtype="float32", device="cpu", max_model_len=2 * WINDOW)
        ):
            pass

    with pytest.raises(ValueError, match="sliding window"):
        asyncio.run(run())
