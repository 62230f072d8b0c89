"""gpu/cpu/codes_cache.py: a converted checkpoint's block codes are searched once, kept beside it, and read
back the same; a damaged file is searched again, and a checkpoint outside the cache is never written to."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from aioengine.gpu.cpu import codes_cache
from aioengine.gpu.cpu.codes_cache import CODES_FILE, checkpoint_codes
from aioengine.model.files import MARKER


def _dequantized(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(dequantize(quantize(x, qtype), qtype).astype(np.float32).reshape(n, k))


@pytest.fixture
def entry(tmp_path):
    """A complete cache entry: float32 Q4_1 shards, a Q8_0 weight and a plain one, and the marker."""
    tensors = {
        "l.gate_proj.weight": _dequantized(Q.Q4_1, 64, 128, 1),
        "l.up_proj.weight": _dequantized(Q.Q4_1, 64, 128, 2),
        "l.q_proj.weight": _dequantized(Q.Q8_0, 64, 128, 3),
        "l.plain.weight": torch.randn(64, 128),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / MARKER).write_text("{}\n")
    return tmp_path


QUESTIONS = [
    (["l.gate_proj.weight", "l.up_proj.weight"], True),
    (["l.q_proj.weight"], False),
    (["l.plain.weight"], True),
]


def _answers(path) -> list:
    with checkpoint_codes(path) as codes:
        return [codes.read(names, affine=affine) for names, affine in QUESTIONS]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    mins = (a.mins is None and b.mins is None) or torch.equal(a.mins, b.mins)
    return torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and a.block == b.block and mins


def test_the_codes_are_kept_and_read_back_without_a_search(entry, monkeypatch):
    first = _answers(entry)
    assert (entry / CODES_FILE).is_file()
    assert first[0] is not None and first[0].mins is not None and first[1] is not None and first[2] is None

    def no_search(*args, **kwargs):
        raise AssertionError("searched again")

    monkeypatch.setattr(codes_cache, "read_block_codes", no_search)
    again = _answers(entry)
    assert all(_same(a, b) for a, b in zip(first, again, strict=True))
    with checkpoint_codes(entry) as codes, pytest.raises(AssertionError, match="searched again"):
        codes.read(["l.q_proj.weight"], affine=True)  # another question: not answered by the file


@pytest.mark.parametrize("damage", ["garbage", "truncated", "shape"])
def test_a_damaged_file_is_searched_again_and_rewritten(entry, damage, caplog):
    first = _answers(entry)
    path = entry / CODES_FILE
    if damage == "garbage":
        path.write_bytes(b"\x00" * 100)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    else:  # a well-formed file whose scales do not fit its codes
        with checkpoint_codes(entry) as codes:
            key = next(k for k, v in codes.found.items() if v is not None and v.mins is None)
            codes.found[key].scales = codes.found[key].scales[:, :1].contiguous()
            codes.added = True
    with caplog.at_level(logging.WARNING, logger=codes_cache.__name__):
        again = _answers(entry)
    assert "ignoring" in caplog.text
    assert all(_same(a, b) for a, b in zip(first, again, strict=True))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=codes_cache.__name__):
        assert all(_same(a, b) for a, b in zip(first, _answers(entry), strict=True))
    assert "ignoring" not in caplog.text  # the rewrite is whole again


def test_a_checkpoint_outside_the_cache_is_not_written_to(entry):
    (entry / MARKER).unlink()
    assert _answers(entry)[0] is not None
    assert not (entry / CODES_FILE).exists()


@pytest.mark.parametrize("where", ["save_file", "mkstemp"])
def test_a_cache_that_cannot_be_written_still_gives_the_codes(entry, monkeypatch, where):
    def refuse(*args, **kwargs):
        raise OSError("read-only file system")

    if where == "save_file":
        monkeypatch.setattr(codes_cache, "save_file", refuse)
    else:  # the directory itself refuses a new file
        monkeypatch.setattr(codes_cache.tempfile, "mkstemp", refuse)
    assert _answers(entry)[0] is not None
    assert not (entry / CODES_FILE).exists()
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]
