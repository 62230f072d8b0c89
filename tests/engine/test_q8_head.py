"""An engine on a checkpoint whose LM head is a Q8_0 dequantization (what a GGUF conversion gives) runs it on
its codes, and its greedy tokens equal transformers' on the same weights (float32: the codes at every batch
size; bf16's switch to the GEMM past a few rows is tests/gpu/cpu/test_q8_head.py's)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.gpu.cpu.q8_head import Q8Head
from aioengine.kernels.cpu import q8
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import NEW_TOKENS, hf_greedy, prompts

pytestmark = pytest.mark.skipif(not q8.available(), reason="the block-code kernels are not vectorized here")


def _as_q8_0(p: torch.Tensor) -> None:
    w = p.detach().numpy()
    q = dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    p.data.copy_(torch.from_numpy(q.reshape(w.shape)))


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_parity_through_the_codes(tmp_path, tied):
    hf = make_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=tied)
    _as_q8_0(hf.get_output_embeddings().weight)
    hf.save_pretrained(tmp_path)
    few, many = prompts(False, 3), prompts(True, 12)

    async def run() -> tuple[list[list[int]], list[list[int]], bool]:
        args = EngineArgs(model=str(tmp_path), dtype="float32", device="cpu", max_num_batched_tokens=256)
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            a = await asyncio.gather(*(engine.generate(p, params) for p in few))
            b = await asyncio.gather(*(engine.generate(p, params) for p in many))
            head = engine.runner.model.lm_head
            on_codes = isinstance(head, Q8Head)
            # where the level prefers FMAs on codes, 3-16 rows take them (both batches here do)
            assert on_codes and (head.fma_from is not None) == q8.f32_fma()
            return [o.outputs[0].token_ids for o in a], [o.outputs[0].token_ids for o in b], on_codes

    got_few, got_many, on_codes = asyncio.run(run())
    assert on_codes
    assert got_few == [hf_greedy(hf, p) for p in few]
    assert got_many == [hf_greedy(hf, p) for p in many]


def test_a_tied_bf16_head_left_unpacked_falls_back_to_its_table_past_a_few_rows(tmp_path):
    """bf16 with plain torch linears (--cpu-linear torch, or a level without bf16 packing): the tied head
    stays the embedding table, and the codes' fallback past MAX_ROWS_BF16 rows is that table as a linear (it
    once called the embedding lookup on hidden states and killed the engine)."""
    from aioengine.config import KernelConfig

    hf = make_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=True)
    _as_q8_0(hf.get_output_embeddings().weight)
    hf.save_pretrained(tmp_path)
    many = prompts(False, 8)

    async def run() -> list[list[int]]:
        args = EngineArgs(
            model=str(tmp_path),
            dtype="bfloat16",
            device="cpu",
            max_num_batched_tokens=256,
            kernels=KernelConfig(cpu_linear="torch"),
        )
        async with AsyncEngine(args) as engine:
            assert isinstance(engine.runner.model.lm_head, Q8Head)
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in many))
            return [o.outputs[0].token_ids for o in outs]

    got = asyncio.run(run())
    assert len(got) == 8 and all(len(t) == 4 for t in got)
