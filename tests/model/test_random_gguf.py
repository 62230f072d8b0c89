"""`random:NAME` for a random GGUF (aioengine/model/random_gguf.py): the file is written once into the cache,
with Q4_K experts and Q8_0 attention, the same bytes for the same seed; the engine serves it as any GGUF file
(its experts on their block codes), greedy-equal to transformers on the same weights dequantized; a name
it does not know is refused naming the ones it does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from aioengine import AsyncEngine, EngineArgs, SamplingParams
from aioengine.model.float_checkpoint import reference_checkpoint
from aioengine.model.gguf_file import read_header
from aioengine.model.random_gguf import GGUF_SHAPES, gguf_alias, random_gguf_path, write_moe_gguf
from aioengine.model.source import resolve_source
from tests.engine.greedy_ref import hf_greedy

NAME = "random:moe-tiny-q4_k"


def test_the_file_is_written_once_with_its_shape_and_block_types(tmp_path, monkeypatch):
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path))
    path = gguf_alias(NAME)
    assert path is not None and path == str(tmp_path / "random" / "moe-tiny-q4_k-seed0.gguf")
    header = read_header(path)
    shape = GGUF_SHAPES["moe-tiny-q4_k"]
    assert header.metadata["general.architecture"] == "qwen3moe"
    assert header.metadata["qwen3moe.expert_count"] == shape.experts
    types = {name: t.type_name for name, t in header.tensors.items()}
    assert types["blk.1.ffn_down_exps.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q8_0"
    file = tmp_path / "random" / "moe-tiny-q4_k-seed0.gguf"
    stamp = file.stat().st_mtime_ns
    assert gguf_alias(NAME) == path and random_gguf_path("moe-tiny-q4_k") == file
    assert file.stat().st_mtime_ns == stamp  # written once
    other = tmp_path / "again.gguf"
    write_moe_gguf(other, shape, seed=0)
    assert other.read_bytes() == file.read_bytes()  # a seed makes the same file
    assert gguf_alias("random:tiny") is None and gguf_alias("moe-tiny-q4_k") is None
    assert not list((tmp_path / "random").glob("*.tmp"))


def test_the_engine_serves_it_as_a_gguf_equal_to_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    source = resolve_source(EngineArgs(model=NAME))
    assert not source.path.startswith("random:") and source.name == NAME  # a converted folder, served by name
    hf = AutoModelForCausalLM.from_pretrained(
        reference_checkpoint(Path(source.path), tmp_path / "reference"), dtype=torch.float32
    ).eval()
    prompts = [[5, 900, 33, 4000, 17], list(range(300, 340))]
    expected = [hf_greedy(hf, p) for p in prompts]

    async def run() -> list[list[int]]:
        args = EngineArgs(model=NAME, dtype="float32", max_model_len=256, max_num_batched_tokens=32)
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            text = (
                await engine.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
            ).outputs
            assert text[0].token_ids  # its tokenizer and template are the default model's
        return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(run()) == expected


def test_an_unknown_random_name_lists_the_known_ones():
    from aioengine.gpu.random_model import random_config

    with pytest.raises(ValueError, match="random:olmoe-1b-7b-q4_k"):
        random_config("random:nope")
