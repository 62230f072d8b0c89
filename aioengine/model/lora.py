"""Read a LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors): its rank, its
scaling and each adapted module's A and B, checked against what the engine can apply."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The linears an adapter may target (Hugging Face names), and the decoder block that holds each.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's keys: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter>].weight
_KEY = re.compile(
    r"\blayers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)


class LoRAError(ValueError):
    """An adapter that cannot be served: missing files, a rank above the maximum, wrong shapes, or
    modules the model does not have."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (rsLoRA: / sqrt(r)), folded into B when applied
    # (layer, module) -> (A [r, in], B [out, r]), float32
    weights: dict[tuple[int, str], tuple[Any, Any]]


def read_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter in folder ``path``; raises LoRAError naming the adapter and the problem."""
    import torch
    from safetensors.torch import load_file

    folder = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for p in (config_path, weights_path):
        if not p.is_file():
            raise LoRAError(f"{where}: {p.name} is missing (a PEFT adapter folder holds both files)")
    try:
        config = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise LoRAError(
            f"{where}: adapter_config.json is not a LoRA config ({type(e).__name__}: {e})"
        ) from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoRAError(f"{where}: trained biases and modules_to_save are not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAError(
            f"{where}: target modules {unknown} are not ones the model has; "
            f"supported: {', '.join(TARGET_MODULES)}"
        )
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors' own errors: a cut or foreign file
        raise LoRAError(f"{where}: adapter_model.safetensors cannot be read: {e}") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None or m["module"] not in TARGET_MODULES:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA weight of {', '.join(TARGET_MODULES)}")
        pairs.setdefault((int(m["layer"]), m["module"]), {})[m["ab"]] = value.float()
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            shapes = {k: list(v.shape) for k, v in ab.items()}
            raise LoRAError(
                f"{where}: layer {layer} {module}: A and B must be [{rank}, in] and [out, {rank}], "
                f"got {shapes}"
            )
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, path, rank, scaling, weights)
