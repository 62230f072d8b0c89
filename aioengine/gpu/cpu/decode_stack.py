"""Decode-only steps on the CPU through cpu_decode_stack.c: all decoder layers in one C call, same bits.

Applies to bf16 Llama-family layers (Llama, Mistral, SmolLM, Qwen2) once ``pack_linears`` has packed every
linear for cpu_gemm.c and fused the MLP's activation into gate_up; Qwen3's q/k norms, float32, and mixed
steps with prompt chunks keep the Python path. ``KernelConfig.cpu_decode_stack=False`` turns it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aioengine.gpu.cpu.linear import PackedLinear
from aioengine.kernels.cpu import clib as cpu_kernels
from aioengine.kernels.metadata import AttentionMetadata

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class _LayerWeights(ctypes.Structure):  # cpu_decode_stack.c's layer_weights
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "down",
            "down_bias",
            "key_cache",
            "value_cache",
        )
    ]


class _StackArgs(ctypes.Structure):  # cpu_decode_stack.c's stack_args
    _fields_ = [
        ("hidden", _I64),
        ("intermediate", _I64),
        ("num_heads", _I64),
        ("num_kv_heads", _I64),
        ("head_dim", _I64),
        ("eps", _F),
        ("scale", _F),
        ("cos2", _P),
        ("sin2", _P),
        ("block_size", _I64),
        ("block_stride", _I64),
        ("token_stride", _I64),
        ("head_stride", _I64),
        ("num_slots", _I64),
        ("act_table", _P),
        ("rows", _I64),
        ("positions", _P),
        ("slots", _P),
        ("block_table", _P),
        ("seq_lens", _P),
        ("table_stride", _I64),
        ("normed", _P),
        ("qkv_out", _P),
        ("qk_rotated", _P),
        ("attn", _P),
        ("act", _P),
        ("num_threads", _I),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _packed(module: Any, epilogue: int) -> bool:
    return isinstance(module, PackedLinear) and module.c_gemm and module.epilogue == epilogue


class CpuDecodeStack:
    """The layers' pointers, gathered once; ``run`` fills a step's inputs and makes the call."""

    def __init__(
        self, model: nn.Module, kv_caches: list[torch.Tensor], cos2: torch.Tensor, sin2: torch.Tensor
    ) -> None:
        decoder = model.model
        first = decoder.layers[0]
        attn, mlp = first.self_attn, first.mlp
        cache = kv_caches[0]
        self.layers = (_LayerWeights * len(decoder.layers))()
        for w, layer, kv in zip(self.layers, decoder.layers, kv_caches, strict=True):
            a, m = layer.self_attn, layer.mlp
            w.input_norm, w.post_norm = (
                _ptr(layer.input_layernorm.weight),
                _ptr(layer.post_attention_layernorm.weight),
            )
            w.qkv, w.qkv_bias = _ptr(a.qkv_proj.packed), _ptr(a.qkv_proj.bias)
            w.o, w.o_bias = _ptr(a.o_proj.packed), _ptr(a.o_proj.bias)
            w.gate_up, w.down, w.down_bias = (
                _ptr(m.gate_up_proj.packed),
                _ptr(m.down_proj.packed),
                _ptr(m.down_proj.bias),
            )
            w.key_cache, w.value_cache = cpu_kernels.cache_pointers(kv)
        self.args = _StackArgs(
            hidden=attn.o_proj.out_features,
            intermediate=mlp.gate_up_proj.out_features // 2,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            eps=first.input_layernorm.variance_epsilon,
            scale=attn.scaling,
            cos2=_ptr(cos2),
            sin2=_ptr(sin2),
            block_size=cache.shape[2],
            block_stride=cache.stride(1),
            token_stride=cache.stride(2),
            head_stride=cache.stride(3),
            num_slots=cache.shape[1] * cache.shape[2],
            act_table=cpu_kernels.activation_table("silu").data_ptr(),
        )
        self.widths = {
            "normed": self.args.hidden,
            "qkv_out": attn.q_size + 2 * attn.kv_size,
            "qk_rotated": attn.q_size + attn.kv_size,
            "attn": attn.q_size,
            "act": self.args.intermediate,
        }
        self._keep = (kv_caches, cos2, sin2)  # the pointers above stay valid while these live

    @staticmethod
    def build(
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        rope_tables: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> CpuDecodeStack | None:
        """The stack for this model and cache, or None where the C call does not apply. ``rope_tables(cache)``
        gives the full-width ``(cos2, sin2)`` tables of a rotary ``cos_sin_cache``."""
        if not kv_caches:
            return None
        decoder = getattr(model, "model", None)
        if not getattr(decoder, "layers", None) or kv_caches[0].dtype != torch.bfloat16:
            return None
        eps = decoder.layers[0].input_layernorm.variance_epsilon
        for layer in decoder.layers:
            a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (
                a is None
                or m is None
                or getattr(a, "sliding_window", None) is not None  # the C stack attends to every position
                or a.q_norm is not None
                or not _packed(a.qkv_proj, cpu_kernels.GEMM_BF16)
                or not _packed(a.o_proj, cpu_kernels.GEMM_BF16)
                or not isinstance(m.act_fn, nn.Identity)
                or not _packed(m.gate_up_proj, cpu_kernels.GEMM_ACT_MUL)
                or not _packed(m.down_proj, cpu_kernels.GEMM_BF16)
                or layer.input_layernorm.variance_epsilon != eps
                or layer.post_attention_layernorm.variance_epsilon != eps
            ):
                return None
        attn = decoder.layers[0].self_attn
        cos2, sin2 = rope_tables(attn.rotary_emb.cos_sin_cache)
        if cos2.dtype != torch.bfloat16 or not cos2.is_contiguous():
            return None
        query = torch.empty(
            1, attn.num_heads, attn.head_dim, dtype=torch.bfloat16
        )  # the decode kernel's limits
        return (
            CpuDecodeStack(model, kv_caches, cos2, sin2)
            if cpu_kernels.supports(query, kv_caches[0])
            else None
        )

    @staticmethod
    def takes(input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step of decodes only (no prompt chunk, no padding)."""
        return meta.num_decodes == meta.num_reqs == input_ids.shape[0] > 0

    def run(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings ``[rows, H]`` -> (the last layer's output, the residual stream), both ``[rows, H]``."""
        rows = hidden.shape[0]
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        scratch = {
            name: torch.empty((rows, width), dtype=torch.bfloat16) for name, width in self.widths.items()
        }
        positions = (
            positions
            if positions.dtype == torch.int64 and positions.is_contiguous()
            else positions.to(torch.int64).contiguous()
        )
        slots = (
            meta.slot_mapping if meta.slot_mapping.dtype == torch.int64 else meta.slot_mapping.to(torch.int64)
        )
        table = (
            meta.block_table if meta.block_table.dtype == torch.int32 else meta.block_table.to(torch.int32)
        )
        seq_lens = meta.seq_lens if meta.seq_lens.dtype == torch.int32 else meta.seq_lens.to(torch.int32)
        assert table.stride(1) == 1 and seq_lens.is_contiguous() and slots.is_contiguous()
        a = self.args
        a.rows, a.positions, a.slots = rows, positions.data_ptr(), slots.data_ptr()
        a.block_table, a.table_stride, a.seq_lens = table.data_ptr(), table.stride(0), seq_lens.data_ptr()
        for name, t in scratch.items():
            setattr(a, name, t.data_ptr())
        a.num_threads = torch.get_num_threads()
        status = cpu_kernels.load().decode_stack_bf16(
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(a),
            hidden.data_ptr(),
            residual.data_ptr(),
        )
        assert status == 0, f"decode_stack_bf16 failed ({status})"
        return hidden, residual
