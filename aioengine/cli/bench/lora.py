"""Random LoRA adapters (PEFT's file format) for a model's shapes, so `bench throughput --random-loras N`
measures multi-LoRA serving on any model without training or downloading adapters."""

from __future__ import annotations

import json
import os
from pathlib import Path

from aioengine.model.lora import TARGET_MODULES


def model_shapes(model: str) -> dict[str, int]:
    """hidden, q and kv widths, intermediate, layers of the model named as EngineArgs.model names it."""
    from aioengine.config import EngineArgs
    from aioengine.model.source import resolve_source

    path = resolve_source(EngineArgs(model=model)).path
    if path.startswith("random:"):
        from aioengine.gpu.random_model import random_config

        cfg = random_config(path).to_dict()
    else:
        cfg = json.loads((Path(path) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {
        "hidden": cfg["hidden_size"],
        "q": heads * head_dim,
        "kv": (cfg.get("num_key_value_heads") or heads) * head_dim,
        "inter": cfg["intermediate_size"],
        "layers": cfg["num_hidden_layers"],
    }


def write_random_adapters(
    model: str, n: int, rank: int, out: str | os.PathLike[str], scale: float = 0.01
) -> dict[str, str]:
    """``n`` adapters of rank ``rank`` on every target module, seeded random A and B of standard deviation
    ``scale`` (small: the base model's text stays readable): name -> folder."""
    import torch
    from safetensors.torch import save_file

    s = model_shapes(model)
    # (module, block, input width, output width)
    modules = [
        ("q_proj", "self_attn", s["hidden"], s["q"]),
        ("k_proj", "self_attn", s["hidden"], s["kv"]),
        ("v_proj", "self_attn", s["hidden"], s["kv"]),
        ("o_proj", "self_attn", s["q"], s["hidden"]),
        ("gate_proj", "mlp", s["hidden"], s["inter"]),
        ("up_proj", "mlp", s["hidden"], s["inter"]),
        ("down_proj", "mlp", s["inter"], s["hidden"]),
    ]
    assert [m[0] for m in modules] == list(TARGET_MODULES)
    adapters = {}
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(s["layers"]):
            for module, block, k, m in modules:
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * scale
                tensors[f"{key}.lora_B.weight"] = torch.randn(m, rank, generator=gen) * scale
        folder = Path(out) / f"lora-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        targets = list(TARGET_MODULES)
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        adapters[f"lora-{i}"] = str(folder)
    return adapters
