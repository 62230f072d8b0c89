"""A converted checkpoint whose mixture's experts are block codes (model/gguf_codes.py), as transformers
reads it: every tensor in float32 under the Hub's names, written once beside it (the parity tests'
reference and the bench's transformers peer)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from aioengine.model.checkpoint import safetensors_files
from aioengine.model.gguf_codes import EXPERT_CODES, Codes, unpack_nibbles

_MIXTRAL = {"gate": "w1", "up": "w3", "down": "w2"}  # the Hub's Mixtral names of an expert's projections
REFERENCE_DIR = "float32-reference"


def has_codes(folder: Path) -> bool:
    """Whether a converted checkpoint holds a mixture's experts as codes."""
    return any(EXPERT_CODES.match(name) for name in _tensor_names(folder))


def dequantized_tensors(folder: Path) -> dict[str, np.ndarray]:
    """A converted checkpoint's tensors in float32 under the Hub's names, its expert codes dequantized per
    expert (Qwen-MoE's ``mlp.experts.<e>.gate_proj``; Mixtral's ``block_sparse_moe.experts.<e>.w1``)."""
    from safetensors.numpy import load_file

    loaded: dict[str, np.ndarray] = {}
    for file in _files(folder):
        loaded |= load_file(str(file))
    mixtral = json.loads((folder / "config.json").read_text()).get("model_type") == "mixtral"
    out = {name: t for name, t in loaded.items() if ".mlp.experts." not in name or name.endswith(".weight")}
    for name in loaded:
        m = EXPERT_CODES.match(name)
        if m is None or m["part"] != "codes":
            continue
        base = name.removesuffix(".codes")
        mins = loaded.get(f"{base}.mins")
        codes = loaded[name] if mins is None else unpack_nibbles(loaded[name])
        scales = loaded[f"{base}.scales"]
        w = Codes(codes, scales, codes.shape[-1] // scales.shape[-1], mins).dequantize()
        parts = ("gate", "up") if m["proj"] == "gate_up" else ("down",)
        rows = w.shape[1] // len(parts)
        for i, part in enumerate(parts):
            for e in range(w.shape[0]):
                if mixtral:
                    hf = f"{m['layer']}.block_sparse_moe.experts.{e}.{_MIXTRAL[part]}.weight"
                else:
                    hf = f"{m['layer']}.mlp.experts.{e}.{part}_proj.weight"
                out[hf] = np.ascontiguousarray(w[e, i * rows : (i + 1) * rows])
    return out


def reference_checkpoint(folder: Path, out: Path | None = None) -> Path:
    """``folder`` (a converted checkpoint) as transformers loads it: its config and tokenizer files and every
    tensor in float32 (``dequantized_tensors``), written once into ``out`` (default: a folder inside it)."""
    import torch
    from safetensors.torch import save_file

    out = folder / REFERENCE_DIR if out is None else out
    if (out / "model.safetensors").is_file():
        return out
    tmp = Path(tempfile.mkdtemp(prefix=".reference-", dir=out.parent))
    try:
        for f in folder.iterdir():
            if f.is_file() and not f.name.startswith((".", "model")) and f.suffix != ".safetensors":
                shutil.copy(f, tmp / f.name)
        tensors = {k: torch.from_numpy(v) for k, v in dequantized_tensors(folder).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)  # an earlier attempt's leftovers
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _files(folder: Path) -> list[Path]:
    try:
        return [Path(f) for f in safetensors_files(folder)]
    except FileNotFoundError:  # no weights at all: no codes
        return []


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in _files(folder):
        with safe_open(str(file), framework="np") as f:
            names += list(f.keys())
    return names
