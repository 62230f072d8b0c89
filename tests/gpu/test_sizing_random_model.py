"""KV sizing arithmetic, warm-up batch shapes, and random:NAME models (built on CPU, run by the engine)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.cli.bench import main as bench_main
from aioengine.errors import InvalidRequestError
from aioengine.gpu.cuda.memory import MemoryProfile, kv_cache_blocks, warmup_lengths
from aioengine.gpu.loader import kv_cache_bytes_per_block
from aioengine.gpu.random_model import build_random_model, is_random_model, random_config

GIB = 1 << 30


def test_kv_blocks_from_measured_memory():
    # An H200-like budget: 141 GiB x 0.9, 16 GiB of weights + activations at peak, 1 GiB outside torch.
    p = MemoryProfile(total_bytes=141 * GIB, peak_torch_bytes=16 * GIB, non_torch_bytes=1 * GIB)
    per_block = kv_cache_bytes_per_block(random_config("random:llama-3.1-8b"), 16, torch.bfloat16)
    assert per_block == 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, 8 heads of 128, bf16
    expected = (int(141 * GIB * 0.9) - 17 * GIB) // per_block
    assert kv_cache_blocks(p, 0.9, per_block) == expected
    assert kv_cache_blocks(p, 0.1, per_block) == 0  # over budget already: no blocks, never negative
    assert kv_cache_blocks(MemoryProfile(1000, 100, 0), 1.0, 100) == 9


@pytest.mark.parametrize(
    ("tokens", "max_len", "seqs", "expected"),
    [
        (8192, 131072, 1024, [8192]),
        (8192, 2048, 1024, [2048] * 4),
        (5000, 2048, 1024, [2048, 2048, 904]),
        (8192, 2048, 2, [2048, 2048]),
    ],
)
def test_warmup_lengths(tokens, max_len, seqs, expected):
    assert warmup_lengths(tokens, max_len, seqs) == expected


def test_random_configs_have_the_promised_shapes():
    c = random_config("random:llama-3.1-8b")
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.intermediate_size,
        c.vocab_size,
    ) == (4096, 32, 32, 8, 14336, 128256)
    assert c.architectures == ["LlamaForCausalLM"]
    assert is_random_model("random:tiny") and not is_random_model("default") and not is_random_model(None)
    with pytest.raises(ValueError, match="unknown random model"):
        random_config("random:nope")


def test_random_tiny_builds_on_cpu_with_finite_outputs():
    model, config = build_random_model("random:tiny", torch.float32, "cpu", seed=1)
    again, _ = build_random_model("random:tiny", torch.float32, "cpu", seed=1)
    p = dict(model.named_parameters())
    assert all(torch.equal(t, dict(again.named_parameters())[n]) for n, t in p.items())  # seeded
    assert p["model.norm.weight"].mean().item() == pytest.approx(1.0, abs=0.05)
    assert (
        sum(t.numel() for t in p.values())
        == model.config.vocab_size * 64 * 2 + 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    )


def test_engine_runs_random_tiny_from_token_ids(caplog):
    async def main():
        async with AsyncEngine(EngineArgs(model="random:tiny", device="cpu", dtype="float32")) as engine:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate([3, 4, 5 + i], params) for i in range(3)))
            with pytest.raises(InvalidRequestError, match="no tokenizer"):
                engine.generate("text needs a tokenizer", params)
            return outs

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        outs = asyncio.run(main())
        gc.collect()
    assert all(len(o.outputs[0].token_ids) == 6 and o.outputs[0].text == "" for o in outs)
    # No tokenizer, so no grammar tables: start() waited for that build's failure without leaving it
    # unretrieved.
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


@pytest.mark.parametrize("name", ["random:tiny", "random:moe-tiny"])
def test_bench_throughput_on_random_tiny(tmp_path, name):
    """A mixture's roofline and bytes per token count the parameters a token runs through: its chosen
    experts (top-2 of 8 here), not all of them."""
    out = tmp_path / "r.json"
    assert (
        bench_main(
            [
                "throughput",
                "--model",
                name,
                "--device",
                "cpu",
                "--dataset",
                "sharegpt",
                "--num-prompts",
                "5",
                "--sharegpt-max-len",
                "40",
                "--max-model-len",
                "128",
                "--no-progress",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["num_requests"] == 5 and r["output_tokens"] > 0
    assert r["mean_ttft_ms"] > 0 and r["mean_tpot_ms"] > 0
    assert "gpu_idle_fraction" not in r  # CPU: no CUDA events
    c = random_config(name)
    idle_experts = 0
    if name == "random:moe-tiny":  # every layer routes: each token skips 6 of 8 experts of 3 x 64 x 32
        assert (c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size) == (
            8,
            2,
            64,
            32,
        )
        idle_experts = c.num_hidden_layers * 6 * 3 * 64 * 32
    assert r["num_parameters"] - r["num_active_parameters"] == idle_experts
    width = {"float32": 4, "bfloat16": 2}[r["dtype"]]
    assert r["active_weight_bytes_per_token"] == r["num_active_parameters"] * width
    assert r["roofline_tokens_per_s"] == pytest.approx(
        r["matmul_gflops"] * 1e9 / (2 * r["num_active_parameters"])
    )
