"""LoRA adapters on a loaded model: forward hooks on the decoder's linears add each adapter's delta to its
own rows of the step. A step without adapter rows runs the model untouched (C stack, CUDA graphs)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from aioengine.gpu.backend import Ops
from aioengine.kernels.reference_lora import block_diagonal_b
from aioengine.model.lora import LoRAAdapter, LoRAError


class LoRASlots:
    """A model's adapters in fixed slots (a request's slot 1..N; 0 is the base model, which has no weights
    here) and which slot each row of the step takes."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        adapters: list[LoRAAdapter],
        max_rank: int,
        ops: Ops,
        dtype: torch.dtype,
    ) -> None:
        self.names = [a.name for a in adapters]
        self.ops = ops
        self.num_adapters = len(adapters)
        self.max_rank = max_rank
        # this step's [tokens, slots * rank]: 1 over the rank of each row's adapter (None: no adapter rows)
        self.mask: torch.Tensor | None = None
        self.dtype = dtype
        decoder: Any = getattr(model, "model", None)
        layers = list(getattr(decoder, "layers", None) or [])
        wanted = {key for a in adapters for key in a.weights}
        for layer_index, _ in sorted(wanted):
            if layer_index >= len(layers):
                raise LoRAError(
                    f"LoRA weights for layer {layer_index}, but the model has {len(layers)} layers"
                )
        hidden, inter = int(config.hidden_size), int(getattr(config, "intermediate_size", 0) or 0)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
            # (owner, linear, its checkpoint modules, input width, each module's output width)
            shapes = [
                (
                    attn,
                    "qkv_proj",
                    ("q_proj", "k_proj", "v_proj"),
                    hidden,
                    (attn.q_size, attn.kv_size, attn.kv_size),
                ),
                (attn, "o_proj", ("o_proj",), attn.q_size, (hidden,)),
                (mlp, "gate_up_proj", ("gate_proj", "up_proj"), hidden, (inter, inter)),
                (mlp, "down_proj", ("down_proj",), inter, (hidden,)),
            ]
            for owner, attr, parts, in_features, sizes in shapes:
                if not any((i, p) in wanted for p in parts):
                    continue
                linear = getattr(owner, attr, None)
                if linear is None:  # e.g. a mixture's routed experts: no dense gate/up/down
                    targets = sorted(p for p in parts if (i, p) in wanted)
                    raise LoRAError(f"LoRA targets {targets} of layer {i}, which this model lacks")
                # the delta goes in before the gated activation: a linear that fused it would hide it
                assert attr != "gate_up_proj" or not isinstance(owner.act_fn, nn.Identity), "fused activation"
                self._attach(linear, i, parts, in_features, sizes, adapters, max_rank, dtype)

    def _attach(
        self,
        linear: nn.Module,
        layer: int,
        parts: tuple[str, ...],
        in_features: int,
        sizes: tuple[int, ...],
        adapters: list[LoRAAdapter],
        max_rank: int,
        dtype: torch.dtype,
    ) -> None:
        n = len(adapters)
        lora_a = torch.zeros(len(parts), n, max_rank, in_features, dtype=dtype)
        lora_b = [torch.zeros(n, size, max_rank, dtype=dtype) for size in sizes]
        for slot, adapter in enumerate(adapters):  # request slot ``slot + 1``
            for p, part in enumerate(parts):
                ab = adapter.weights.get((layer, part))
                if ab is None:
                    continue
                a, b = ab
                if a.shape[1] != in_features or b.shape[0] != sizes[p]:
                    raise LoRAError(
                        f"LoRA adapter {adapter.name!r}: layer {layer} {part}: A {list(a.shape)}, B "
                        f"{list(b.shape)}; the model's {part} maps {in_features} inputs to {sizes[p]} outputs"
                    )
                lora_a[p, slot, : adapter.rank] = a.to(dtype)
                lora_b[p][slot, :, : adapter.rank] = (b * adapter.scaling).to(dtype)
        a_flat = lora_a.reshape(-1, in_features)  # [P * S * R, K]
        b_flat = block_diagonal_b(lora_b)  # [P * S * R, out]

        def add_delta(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self.mask is not None:
                self.ops.add_lora(out, args[0], a_flat, b_flat, self.mask)

        linear.register_forward_hook(add_delta)

    @property
    def active(self) -> bool:
        return self.mask is not None

    def set_step(self, token_slots: np.ndarray, to_device: Any) -> None:
        """This step's adapter of each token (0: none) -> which slot's delta each row takes."""
        if not token_slots.any():
            self.mask = None
            return
        onehot = np.zeros((len(token_slots), self.num_adapters + 1), dtype=np.float32)
        onehot[np.arange(len(token_slots)), token_slots] = 1.0
        # column 0, the base model's rows, is dropped: they take no delta
        self.mask = to_device(np.repeat(onehot[:, 1:], self.max_rank, axis=1)).to(self.dtype)
