"""An engine on a checkpoint whose projections are Q4_1 dequantizations (the default model's file type) runs
its decoder linears on the 4-bit codes and offsets, and its greedy tokens equal transformers' on the same
weights (float32, where the codes serve steps of up to 16 rows: every decode step here)."""

from __future__ import annotations

import asyncio

import pytest

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.kernels.cpu import q8
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import NEW_TOKENS, hf_greedy, prompts
from tests.gpu.cpu.block_coded import as_block_codes

pytestmark = pytest.mark.skipif(not q8.available(), reason="the block-code kernels need AVX512-VNNI")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_through_the_4_bit_codes(tmp_path, arch):
    hf = make_tiny_checkpoint(arch, tmp_path, hidden_size=128, intermediate_size=256)
    as_block_codes(hf, q4_1=True)
    hf.save_pretrained(tmp_path)
    few, many = prompts(False, 3), prompts(True, 12)

    async def run() -> tuple[list[list[int]], list[list[int]], int]:
        args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=256)
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            a = await asyncio.gather(*(engine.generate(p, params) for p in few))
            b = await asyncio.gather(*(engine.generate(p, params) for p in many))
            modules = engine.runner.model.modules()
            coded = [m for m in modules if isinstance(m, Q8Linear) and m.mins is not None]
            return [o.outputs[0].token_ids for o in a], [o.outputs[0].token_ids for o in b], len(coded)

    got_few, got_many, num_coded = asyncio.run(run())
    assert num_coded == 4 * hf.config.num_hidden_layers
    assert got_few == [hf_greedy(hf, p) for p in few]
    assert got_many == [hf_greedy(hf, p) for p in many]
