"""An engine on a checkpoint whose projections are Q4_1 dequantizations (the default model's file type) runs
its decoder linears on the 4-bit codes and offsets, and its greedy tokens equal transformers' on the same
weights (float32, where the codes serve steps of up to 16 rows: every decode step here)."""

from __future__ import annotations

import asyncio

import pytest

from aioengine.gpu.cpu.q8_linear import Q8Linear
from aioengine.kernels.cpu import q8
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import hf_greedy, prompts, run_engine
from tests.gpu.cpu.block_coded import as_block_codes

pytestmark = pytest.mark.skipif(not q8.available(), reason="the block-code kernels are not vectorized here")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_through_the_4_bit_codes(tmp_path, arch):
    hf = make_tiny_checkpoint(arch, tmp_path, hidden_size=128, intermediate_size=256)
    as_block_codes(hf, q4_1=True)
    hf.save_pretrained(tmp_path)
    for ps in (prompts(False, 3), prompts(True, 12)):  # a few decodes a step, then many
        got, engine = asyncio.run(run_engine(tmp_path, ps, max_num_batched_tokens=256))
        coded = [m for m in engine.runner.model.modules() if isinstance(m, Q8Linear) and m.mins is not None]
        assert len(coded) == 4 * hf.config.num_hidden_layers
        assert got == [hf_greedy(hf, p) for p in ps]
