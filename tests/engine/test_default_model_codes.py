"""The default model (SmolLM2-135M, every decoder projection Q4_1 in its GGUF) runs its decoder linears on
the file's 4-bit codes and offsets, and its greedy tokens equal transformers' on the converted weights
(float32; a divergence counts only where transformers' top-2 logits are more than 1e-3 apart)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.kernels.cpu import q8
from aioengine.model.files import resolve_model
from tests.engine.greedy_ref import NEW_TOKENS, assert_equal_up_to_ties, hf_greedy

pytestmark = pytest.mark.skipif(not q8.available(), reason="the block-code kernels are not vectorized here")

TEXTS = (
    "The river rises every spring when the snow in the mountains begins to melt.",
    "def area(width, height):\n    return width * height\n\nclass Point:\n    def __init__(self, x, y):",
    "Customers who order before noon receive their packages on the same day. " * 12,
)


def test_greedy_parity_through_the_files_4_bit_codes():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model("default")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [AutoTokenizer.from_pretrained(folder)(t).input_ids for t in TEXTS]

    async def run() -> tuple[list[list[int]], list[Q8Linear]]:
        args = EngineArgs(model="default", dtype="float32", max_num_batched_tokens=64)  # chunked prefill
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            coded = [m for m in engine.runner.model.modules() if isinstance(m, Q8Linear)]
            return [o.outputs[0].token_ids for o in outs], coded

    got, coded = asyncio.run(run())
    assert len(coded) == 4 * hf.config.num_hidden_layers and all(m.mins is not None for m in coded)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert_equal_up_to_ties(hf, prompt, hf_greedy(hf, prompt), tokens)
