"""gpt-oss's own parts: MXFP4 experts in safetensors (as OpenAI ships them: ``*_blocks`` and ``*_scales``)
decoded exactly as transformers decodes them, and a checkpoint stored that way keeping greedy parity with
transformers on the decoded weights. Sinks, windows, biases, YaRN and the clamped SwiGLU are in every test
that runs the tiny checkpoints (test_parity, test_moe, test_quant, test_spec_decode)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from aioengine.model.mxfp4 import E2M1, dequantize_mxfp4
from tests.engine.conftest import make_tiny_checkpoint
from tests.engine.test_parity import hf_greedy, prompts, run_engine


def _random_mxfp4(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``[*shape, 16]`` and scales ``shape`` with exponents near 1 (2^-3 .. 2^0)."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(124, 128, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def test_mxfp4_decodes_as_transformers_and_by_hand():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = _random_mxfp4(gen, 3, 8, 4)  # 3 experts, 8 outputs, 4 blocks of 32 inputs
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 8, 128) and ours.dtype == torch.float32
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))
    # byte 0x71 of a block with scale 128 (x2): its low nibble 1 (0.5) comes first, then 7 (6.0)
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x71
    got = dequantize_mxfp4(one, torch.tensor([128], dtype=torch.uint8))
    assert got[:2].tolist() == [1.0, 12.0] and got[2:].abs().sum() == 0
    assert len(E2M1) == 16 and E2M1[9] == -0.5
    with pytest.raises(ValueError, match="do not fit scales"):
        dequantize_mxfp4(blocks, scales[..., :3])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), scales)


def _mxfp4_checkpoint(path):
    """The tiny gpt-oss with its experts rewritten as MXFP4 codes in the file, and the transformers model
    holding the decoded weights (the reference)."""
    hf = make_tiny_checkpoint("gpt_oss", path)
    gen = torch.Generator().manual_seed(1)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = tensors[name].shape  # transformers' [E, in, out]
        blocks, scales = _random_mxfp4(gen, e, d_out, d_in // 32)
        decoded = dequantize_mxfp4(blocks, scales).transpose(1, 2)
        with torch.no_grad():
            hf.get_parameter(name).copy_(decoded)
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize("tp", [1, 2])
def test_an_mxfp4_checkpoint_keeps_greedy_parity(tmp_path, tp):
    """At TP = 2 each rank reads its 64 of the experts' 128 columns straight from the blocks and scales."""
    hf = _mxfp4_checkpoint(tmp_path)
    ps = prompts(shared_prefix=False, n=6)
    expected = [hf_greedy(hf, p) for p in ps]
    got, _ = asyncio.run(run_engine(tmp_path, ps, max_num_batched_tokens=32, tensor_parallel_size=tp))
    assert got == expected


def test_mxfp4_blocks_without_their_scales_are_refused(tmp_path):
    _mxfp4_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"without their other half.*layers\.1\.mlp\.experts\.down_proj_blocks"
    ):
        asyncio.run(run_engine(tmp_path, [[5, 6, 7]]))


def test_a_gguf_in_llama_cpps_layout_keeps_greedy_parity(tmp_path):
    """gpt-oss from GGUF as llama.cpp's converter writes it (gate and up experts split, biases per part,
    sinks as attn_sinks.weight, YaRN in the metadata): converted, it keeps greedy parity with transformers.
    llama.cpp stores no SwiGLU clamp, so the model clamps at the released models' 7.0."""
    from aioengine.model.files import convert_gguf
    from tests.engine.conftest import SMALL, TINY, save_tiny
    from tests.gguf_writer import TINY_VOCAB, write_tiny_gpt_oss

    config_cls, model_cls, extra = TINY["gpt_oss"]
    torch.manual_seed(0)
    config = config_cls(**{**SMALL, **extra, "vocab_size": TINY_VOCAB, "swiglu_limit": 7.0})
    hf = save_tiny(model_cls(config), tmp_path / "hf", tokenizer=False)
    with torch.no_grad():  # a clamp the random weights reach even at 7.0
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(3.0)
    gguf_path = tmp_path / "tiny-gpt-oss.gguf"
    write_tiny_gpt_oss(gguf_path, hf)
    folder = convert_gguf(gguf_path, tmp_path / "cache")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    rng = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, TINY_VOCAB, (n,), generator=rng).tolist() for n in (5, 20, 40)]
    expected = [hf_greedy(hf, p) for p in ps]
    got, _ = asyncio.run(run_engine(folder, ps, max_num_batched_tokens=32))
    assert got == expected
