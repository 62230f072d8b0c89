"""LoRA adapters on a loaded model: forward hooks on the decoder's linears add each adapter's delta to its
own rows of the step. A step without adapter rows runs the model untouched (C stack, CUDA graphs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from aioengine.gpu.backend import Ops
from aioengine.kernels.reference_lora import block_diagonal_b
from aioengine.model.lora import LoRAAdapter, LoRAError


@dataclass(slots=True)
class _Adapted:
    """One fused linear's adapter stacks: ``a`` ``[parts, slots, R, in]``, ``b[p]`` ``[slots, out_p, R]``
    (the scaling folded in), and their flat forms the op reads."""

    parts: tuple[str, ...]
    a: torch.Tensor
    b: list[torch.Tensor]
    a_flat: torch.Tensor = field(init=False)  # a view of ``a``: writes to ``a`` show through
    b_flat: torch.Tensor = field(init=False)  # a copy: rebuilt by refresh() after ``b`` changes
    used: bool = False  # some resident adapter targets it (else its hook does nothing)

    def __post_init__(self) -> None:
        self.a_flat = self.a.view(-1, self.a.shape[-1])
        self.refresh()

    def refresh(self) -> None:
        self.b_flat = block_diagonal_b(self.b)


class LoRASlots:
    """``max_loras`` fixed slots for adapters, on every dense decoder linear. A request names its adapter
    by id (never reused: a reloaded name is a new id, so the prefix cache cannot mix them); ``slot_of``
    maps the resident ids to their slots, and each step's rows to the slot they take."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        max_loras: int,
        max_rank: int,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.ops, self.dtype, self.max_rank, self.max_loras = ops, dtype, max_rank, max_loras
        self.slot_of: dict[int, int] = {}  # resident adapter id -> slot 0..max_loras-1
        # this step's [tokens, slots * rank]: 1 over the rank of each row's adapter (None: no adapter rows)
        self.mask: torch.Tensor | None = None
        self.linears: dict[tuple[int, str], tuple[_Adapted, int]] = {}  # (layer, module) -> (stacks, part)
        self.adapted: list[_Adapted] = []  # each fused linear's stacks once
        decoder: Any = getattr(model, "model", None)
        hidden, inter = int(config.hidden_size), int(getattr(config, "intermediate_size", 0) or 0)
        for i, layer in enumerate(getattr(decoder, "layers", None) or []):
            attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
            q, kv = attn.q_size, attn.kv_size
            # (owner, linear, its checkpoint modules, input width, each module's output width)
            shapes = [
                (attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), hidden, (q, kv, kv)),
                (attn, "o_proj", ("o_proj",), q, (hidden,)),
                (mlp, "gate_up_proj", ("gate_proj", "up_proj"), hidden, (inter, inter)),
                (mlp, "down_proj", ("down_proj",), inter, (hidden,)),
            ]
            for owner, attr, parts, in_features, sizes in shapes:
                linear = getattr(owner, attr, None)
                if linear is None:  # a mixture's routed experts: no dense gate/up/down to adapt
                    continue
                # the delta goes in before the gated activation: a linear that fused it would hide it
                assert attr != "gate_up_proj" or not isinstance(owner.act_fn, nn.Identity), "fused activation"
                a = torch.zeros(len(parts), max_loras, max_rank, in_features, dtype=dtype, device=device)
                b = [torch.zeros(max_loras, size, max_rank, dtype=dtype, device=device) for size in sizes]
                adapted = _Adapted(parts, a, b)
                self.adapted.append(adapted)
                for p, part in enumerate(parts):
                    self.linears[(i, part)] = (adapted, p)
                linear.register_forward_hook(self._hook(adapted))

    def _hook(self, adapted: _Adapted) -> Any:
        def add_delta(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self.mask is not None and adapted.used:
                self.ops.add_lora(out, args[0], adapted.a_flat, adapted.b_flat, self.mask)

        return add_delta

    @property
    def active(self) -> bool:
        return self.mask is not None

    def check(self, adapter: LoRAAdapter) -> None:
        """Raise LoRAError unless ``adapter`` fits this model's linears."""
        for (layer, module), (a, b) in adapter.weights.items():
            found = self.linears.get((layer, module))
            if found is None:
                raise LoRAError(
                    f"LoRA adapter {adapter.name!r} targets {module} of layer {layer}, which this model lacks"
                )
            adapted, p = found
            if a.shape[1] != adapted.a.shape[-1] or b.shape[0] != adapted.b[p].shape[1]:
                raise LoRAError(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {module}: A {list(a.shape)}, B "
                    f"{list(b.shape)}; the model's {module} maps {adapted.a.shape[-1]} inputs to "
                    f"{adapted.b[p].shape[1]} outputs"
                )

    def load(self, adapter_id: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` in a free slot; raises LoRAError (nothing changed) when none is free or it does
        not fit the model."""
        free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
        if not free:
            raise LoRAError(f"all {self.max_loras} LoRA slots hold adapters (max_loras): unload one first")
        self.check(adapter)
        slot = free[0]
        touched: dict[int, _Adapted] = {}  # a fused linear once, however many of its parts are adapted
        for (layer, module), (a, b) in adapter.weights.items():
            adapted, p = self.linears[(layer, module)]
            adapted.a[p, slot, : adapter.rank] = a.to(self.dtype)
            adapted.b[p][slot, :, : adapter.rank] = (b * adapter.scaling).to(self.dtype)
            adapted.used = True
            touched[id(adapted)] = adapted
        for adapted in touched.values():
            adapted.refresh()
        self.slot_of[adapter_id] = slot

    def unload(self, adapter_id: int) -> None:
        slot = self.slot_of.pop(adapter_id)
        for adapted in self.adapted:
            adapted.a[:, slot] = 0
            for b in adapted.b:
                b[slot] = 0
            adapted.refresh()

    def set_step(self, token_adapters: np.ndarray, to_device: Any) -> None:
        """This step's adapter id of each token (0: none) -> the slot whose delta each row takes."""
        if not token_adapters.any():
            self.mask = None
            return
        onehot = np.zeros((len(token_adapters), self.max_loras), dtype=np.float32)
        for adapter_id in np.unique(token_adapters):
            if adapter_id:
                onehot[token_adapters == adapter_id, self.slot_of[int(adapter_id)]] = 1.0
        self.mask = to_device(np.repeat(onehot, self.max_rank, axis=1)).to(self.dtype)
